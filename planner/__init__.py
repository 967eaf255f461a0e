"""Sizing and adapting the pools: a discrete-event simulator that runs the real
scheduler and routing policies on a machine's cost model (:mod:`common.cost_model`),
the candidate search behind ``pdserve plan``, and the live planner behind
``pdserve up --autoscale``. No torch, no gRPC: it sits above the router and the
workers (whose pure parts it runs) and below the launchers."""
