"""Sizing and adapting the pools: the machine's cost model (:mod:`planner.profile`), a
discrete-event simulator running the real scheduler and routing policies on it, the
candidate search behind ``pdserve plan``, and the live planner behind
``pdserve up --autoscale``. No torch, no gRPC: it sits above the router and the
workers (whose pure parts it runs) and below the launchers."""
