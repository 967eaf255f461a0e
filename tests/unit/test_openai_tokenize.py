"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` on the router's HTTP
front, over a real :class:`router.core.Router` on fake in-process workers
(tests/fake_workers.py) with a character-per-token tokenizer that can decode."""

from __future__ import annotations

import asyncio
import importlib.metadata
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from fake_workers import MAX_MODEL_LEN, MODEL, VOCAB, Cluster, FakeTokenizer

from router.auth import KeyStore
from router.openai import create_app

BOS = 3
KEY = "sk-acme-user-0123456789"


class DecodingTokenizer(FakeTokenizer):
    """FakeTokenizer with a BOS it adds unless told not to, and ``decode``."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        ids = super().__call__(text).input_ids
        return SimpleNamespace(input_ids=([BOS] if add_special_tokens else []) + ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False) -> list[int]:
        self._enter()  # the base frames each message with 1 and 2, without the BOS
        ids = []
        for m in messages:
            ids += [1] + super().__call__(f"{m['role']}:{m['content']}").input_ids + [2]
        return ids + ([1] if add_generation_prompt else [])

    def decode(self, ids: list[int]) -> str:
        self._enter()
        return "".join(chr(i) for i in ids)


def serve(fn: Any, *, keys: Path | None = None, **app_kwargs: Any) -> DecodingTokenizer:
    """Runs ``await fn(client)`` against the app; returns the tokenizer (its threads)."""
    tok = DecodingTokenizer()

    async def main() -> None:
        async with Cluster(["mixed"], tokenizer=tok) as c:
            app = create_app(c.router, keys=KeyStore(keys) if keys else None, **app_kwargs)
            async with TestClient(TestServer(app)) as client:
                await fn(client)

    asyncio.run(main())
    return tok


async def error_of(resp: Any, status: int) -> dict:
    assert resp.status == status, await resp.text()
    return (await resp.json())["error"]


def test_tokenize_a_prompt_counts_it_and_tells_the_context_length() -> None:
    async def body(http: TestClient) -> None:
        resp = await http.post("/tokenize", json={"model": MODEL, "prompt": "hi!"})
        assert resp.status == 200
        assert await resp.json() == {"tokens": [BOS, 104, 105, 33], "count": 4,
                                     "max_model_len": MAX_MODEL_LEN}
        resp = await http.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})
        assert (await resp.json())["tokens"] == [104, 105]

    tok = serve(body)
    assert tok.threads and threading.get_ident() not in tok.threads  # the tokenizer thread


def test_tokenize_messages_renders_the_chat_template() -> None:
    async def body(http: TestClient) -> None:
        resp = await http.post("/tokenize", json={"messages": [{"role": "user",
                                                                "content": "a"}]})
        assert resp.status == 200
        expected = [1] + [ord(c) for c in "user:a"] + [2, 1]
        assert (await resp.json())["tokens"] == expected

    serve(body)


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary() -> None:
    async def body(http: TestClient) -> None:
        ids = (await (await http.post("/tokenize", json={"prompt": "héllo"})).json())["tokens"]
        resp = await http.post("/detokenize", json={"tokens": ids[1:]})
        assert resp.status == 200 and await resp.json() == {"prompt": "héllo"}
        err = await error_of(await http.post("/detokenize", json={"tokens": [5, VOCAB]}), 400)
        assert err["param"] == "tokens" and f"tokens[1]: {VOCAB}" in err["message"]
        assert f"0 to {VOCAB - 1}" in err["message"]

    serve(body)


def test_bad_bodies_are_400_naming_the_field() -> None:
    cases = [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
         "prompt"),
        ("/tokenize", {"prompt": ["a"]}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                       "add_special_tokens": True}, "add_special_tokens"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ]

    async def body(http: TestClient) -> None:
        for path, payload, param in cases:
            err = await error_of(await http.post(path, json=payload), 400)
            assert err["param"] == param, (path, payload, err)
            assert "Traceback" not in err["message"] and "Error" not in err["message"]
        err = await error_of(await http.post("/tokenize", data=b"{not json"), 400)
        assert err["code"] == "invalid_json"
        err = await error_of(await http.post("/tokenize", json={"model": "gpt-9",
                                                                "prompt": "a"}), 404)
        assert err["param"] == "model"

    serve(body)


def test_bodies_over_the_limit_are_413() -> None:
    async def body(http: TestClient) -> None:
        for path in ("/tokenize", "/detokenize"):
            resp = await http.post(path, data=b"x" * 5000)
            assert resp.status == 413, path

    serve(body, max_body_bytes=1024)


def test_version_is_the_package_version() -> None:
    async def body(http: TestClient) -> None:
        resp = await http.get("/version")
        assert resp.status == 200
        assert await resp.json() == {"version": importlib.metadata.version("pdserve")}

    serve(body)


def test_with_keys_the_new_routes_need_one(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY} acme\n")
    keys.chmod(0o600)

    async def body(http: TestClient) -> None:
        auth = {"Authorization": f"Bearer {KEY}"}
        for method, path, payload in (("POST", "/tokenize", {"prompt": "a"}),
                                      ("POST", "/detokenize", {"tokens": [97]}),
                                      ("GET", "/version", None)):
            resp = await http.request(method, path, json=payload)
            assert resp.status == 401, path
            resp = await http.request(method, path, json=payload, headers=auth)
            assert resp.status == 200, path
        assert (await http.get("/health")).status == 200

    serve(body, keys=keys)
