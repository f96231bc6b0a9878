"""Model code. Shape-suffix glossary used in every numeric name and einsum string:

    B  batch rows                     T  new tokens in this call (query positions)
    S  cache slots (capacity)         D  model width (hidden size)
    V  vocabulary (target)            W  draft vocabulary
    N  attention heads                G  key/value heads (draft GQA)
    H  head dim (q·k part: nope+rope for MLA, plain for the draft)
    P  MLA rope part of a head        O  MLA value head dim
    C  MLA kv latent (kv_lora_rank)   Q  MLA query latent (q_lora_rank)
    F  MLP / expert width             E  experts
    K  experts chosen per token       M  flattened tokens (B·T)
    A  token→expert assignments (M·K) L  layers
    X  concatenated aux width (n_aux · D_target)

e.g. ``q_BTNH`` is queries [batch, tokens, heads, head_dim]; ``w_EDF`` an expert stack.
"""
