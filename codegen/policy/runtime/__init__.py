"""The AutoTP policy runtime, in parts: codegen.policy.assemble joins them (in `PARTS` order) into the one
self-contained file every patched model dir gets. Importing this package imports no part (and no torch)."""

#: the parts, in the order they are assembled; a part imports earlier parts only (see codegen.policy.assemble)
PARTS = ("base", "probe", "environment", "shm", "groups", "experts", "attention", "latent_attention",
         "linear_attention", "lockstep", "kernel", "experts_implementation", "eager_attention", "kv_cache", "compiled",
         "cuda_attention", "entry")
