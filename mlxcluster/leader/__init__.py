"""Rank 0's leader: the one admission queue and continuous-batching decode loop
(:mod:`.scheduler`), the ``Generation`` gRPC service and its client (:mod:`.generation`; text
becomes token ids and back here for ``generate``), and the prefill/decode-disaggregation sides
(:mod:`.pd`).  Runs inside the rank-0 process, over :mod:`mlxcluster.engine` and
:mod:`mlxcluster.control`."""
