"""Control plane: rank 0 -> ranks N transport (:mod:`.link`) and the rank-N follower
(:mod:`.follower`: frame -> engine call)."""
