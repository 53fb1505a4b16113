import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-rotation layout of HF Llama.

    x: [tokens, heads, head_dim]; cos, sin: [tokens, rotary dims], already gathered at each
    token's position (and already multiplied by the rope type's attention scaling). With fewer
    rotary dims than head_dim (partial rotary), the first ones turn and the rest pass through.
    """
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin
