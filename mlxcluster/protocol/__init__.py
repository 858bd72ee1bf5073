"""Wire formats: generated code for ``proto/mlxcluster.proto`` and ``proto/router.proto``,
control frames (:mod:`.frames`) and the OpenAI-format error (:mod:`.errors`)."""
