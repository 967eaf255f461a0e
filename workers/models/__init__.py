"""Model forwards over the paged KV cache (torch only; no scheduling)."""
