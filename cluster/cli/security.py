"""``pdserve certs``: a development CA, the cluster's and the router's certificates and
the KV channel's secret, in one directory (:mod:`cluster.certs` says what each file is
for)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("certs", help="make a development CA, cluster and router "
                       "certificates and a cluster secret (for --cluster-tls-dir, --tls-cert)")
    c.add_argument("--out", required=True, help="directory to write (created 0700)")
    c.add_argument("--hosts", default="",
                   help="comma-separated extra names or addresses clients reach the router "
                        "at (localhost, 127.0.0.1 and ::1 are always in)")
    c.add_argument("--days", type=int, default=365, help="validity of the certificates")
    c.add_argument("--force", action="store_true", help="replace an existing set")
    c.set_defaults(func=cmd_certs)


def cmd_certs(args: argparse.Namespace) -> int:
    from cluster.certs import CertsError, make_dev_pki

    from .options import EXIT_INVALID

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    try:
        pki = make_dev_pki(args.out, hosts, days=args.days, force=args.force)
    except (CertsError, OSError) as e:
        print(f"pdserve certs: {e}", file=sys.stderr)
        return EXIT_INVALID
    d = pki.directory
    print(f"wrote a development PKI to {d} (keys 0600; keep {pki.ca_key.name} off the "
          "cluster)\n"
          f"  cluster mTLS and KV channel:  --cluster-tls-dir {d}  "
          f"[--cluster-secret-file {pki.secret}]\n"
          f"  router's public TLS:          --tls-cert {pki.router_cert} "
          f"--tls-key {pki.router_key}\n"
          f"  clients:                      --tls-ca {pki.ca}\n"
          f"  e.g. pdserve up --cluster-tls-dir {d} --cluster-secret-file {pki.secret} "
          f"--tls-cert {pki.router_cert} --tls-key {pki.router_key}")
    return 0
