"""Random inputs of one GDN layer, shared by the op tests."""

import torch


def rand_layer(n, h, hv, kd, vd, dtype=torch.float32, device="cpu"):
    """Random post-conv inputs of ``n`` tokens (``q, k: [n, h, kd]``, ``v: [n, hv, vd]``,
    ``a, b: [n, hv]``) and gate parameters; about 10% of ``a`` sits above the softplus
    threshold so that both branches of the gate run."""
    a = torch.randn(n, hv, dtype=dtype, device=device)
    a[torch.rand(n, hv, device=device) < 0.1] += 25.0
    return dict(
        q=torch.randn(n, h, kd, dtype=dtype, device=device),
        k=torch.randn(n, h, kd, dtype=dtype, device=device),
        v=torch.randn(n, hv, vd, dtype=dtype, device=device),
        a=a,
        b=torch.randn(n, hv, dtype=dtype, device=device) * 2,
        A_log=torch.empty(hv, dtype=dtype, device=device).uniform_(-3, -0.3),
        dt_bias=torch.randn(hv, dtype=dtype, device=device) * 0.5,
    )


def args(x):
    """The positional layer arguments ``(q, k, v, a, b, A_log, dt_bias)`` of an op."""
    return x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"]
