"""The load-testing harness: workloads, arrivals, metrics, the ``pdserve bench`` driver."""
