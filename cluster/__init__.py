"""Control plane of pdserve.

Bottom layer (imports nothing else of ours): shared state such as the block-hash
contract (`cluster.hashing`). Top layer: the `pdserve` CLI, the composition root.
"""
