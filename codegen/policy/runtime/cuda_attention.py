"""The attention kernel a CUDA rank runs: not cuDNN's, which plans anew for every key length.

torch (2.11, H200, bfloat16) ranks cuDNN's scaled-dot-product attention first on recent GPUs, and cuDNN builds an
execution plan for each new shape. A decode step's key length grows by one every step, so every step meets new
shapes: one step of the toy Qwen3-MoE dir (4 layers) spent 70 of its 88 ms of host time in that setup while the GPU
worked 0.6 ms (docs/gpu/h200-decode-profile.md), the unpatched model alike. Flash and memory-efficient attention take
any length without a plan. So a process whose rank is on a CUDA device runs with cuDNN's attention off, where one of
those two is on (torch then picks among what stays on; a user who left cuDNN's alone on keeps it). It is a switch of
the process, as torch's own, not one around the forward: torch.compile cannot trace it inside a captured graph.
"""

import torch


def cudnn_attention_off(device):
    """Turn cuDNN's attention off for this process where `device` is a CUDA device and flash or memory-efficient
    attention is on; a one-line note of what changed, or None."""
    cuda = torch.backends.cuda
    cudnn_on = getattr(cuda, "cudnn_sdp_enabled", lambda: False)  # a torch older than cuDNN's attention has none
    if device.type != "cuda" or not cudnn_on():
        return None
    if not (cuda.flash_sdp_enabled() or cuda.mem_efficient_sdp_enabled()):
        return None
    cuda.enable_cudnn_sdp(False)
    return ("CUDA: cuDNN's attention turned off in this process (it plans anew for each key length: tens of ms a "
            "decode step); flash or memory-efficient attention runs")
