"""Control plane: rank 0 -> ranks N transport (:mod:`.link`), the rank-N follower
(:mod:`.follower`: frame -> engine call) and the client of rank 0's ``Generation``
service (:mod:`.client`)."""
