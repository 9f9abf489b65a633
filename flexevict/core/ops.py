"""The few tensor operations every model family is built from: linear layers (oneDNN-prepacked
on a CPU in fp32) and RMSNorm. Shapes follow their inputs."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

LINEAR_WEIGHTS = ("wqkv", "wo", "w1", "w2", "wgu", "wd", "lm_head", "proj_in", "proj_out")


class PackedWeight:
    """A linear weight prepacked once for oneDNN (CPU, fp32).

    MKL's sgemm reaches a fraction of oneDNN's speed on the CPUs we run on (bench/cpu_generate.py
    measured 1.7x end to end on SmolLM2); oneDNN wants its own weight layout, so each weight is
    reordered once at load time and the plain tensor is dropped. The ops are the ones
    torch.compile's CPU weight prepacking uses.
    """

    def __init__(self, w: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w)


def onednn_usable(device, dtype) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and os.environ.get("FLEXEVICT_ONEDNN", "1") != "0"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def prepack(weights: dict) -> None:
    """Replace the linear weights of a layer (or the outer weights) by oneDNN-packed ones."""
    for key in LINEAR_WEIGHTS:
        if weights.get(key) is not None:
            weights[key] = PackedWeight(weights[key])


def linear(x, w, b=None):
    if isinstance(w, PackedWeight):
        return torch.ops.mkldnn._linear_pointwise(x, w.packed, b, "none", [], "")
    return F.linear(x, w, b)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)
