"""codegen: rewrite MoE modeling sources so DeepSpeed AutoTP reduces once per MoE layer."""

__version__ = "0.1.0"
