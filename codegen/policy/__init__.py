"""The policy: what runs inside a user's model dir (the runtime, assembled into `autotp_policy.py`), its
rendering, and the `shm` command for the shared-memory buffers DeepSpeed leaves behind."""
