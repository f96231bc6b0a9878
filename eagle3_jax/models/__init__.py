"""Model code. Shape-suffix glossary: every array name ends in one letter per axis, and einsum
strings use the same letters in lower case. Each letter has ONE meaning; a slice, tile or block
of an axis keeps that axis's letter (a tile of latent columns is still C).

    A  token→expert assignments (M·U, flattened)     N  query heads
    B  batch rows                                    O  output features of a stored [out, in] matrix
    C  MLA kv latent (kv_lora_rank)                  P  rope part of an MLA q·k head
    D  model width (hidden size)                     Q  MLA query latent (q_lora_rank)
    E  experts                                       R  query heads per key/value head (N = G·R)
    F  MLP / expert hidden width                     S  cache slots (capacity)
    G  key/value heads (draft GQA)                   T  tokens in this call (query positions)
    H  q·k head width (MLA: Z + P; draft head_dim)   U  experts chosen per token (top-k)
    I  input features of a stored [out, in] matrix   V  target vocabulary
    J  expert blocks (one loop trip each)            W  draft vocabulary
    K  draft tokens per round (K1: the K + 1         X  concatenated aux width (n_aux · D_target)
       positions a verify pass scores)               Y  MLA value head width (v_head_dim)
    L  layers                                        Z  no-rope part of an MLA q·k head
    M  flattened tokens (B·T)

Digits and underscores: ``1`` is an axis of size 1 (``pos_B1``); a digit before a letter
multiplies it (``x_BT2D``: 2·D wide); a trailing ``_`` stands for any further axes
(``stack_E_``). Names without a known shape carry no suffix rather than a wrong one.

e.g. ``q_BTNH`` is queries [batch, tokens, heads, head width]; ``w_EDF`` an expert stack.
``tests/test_glossary.py`` checks every suffix and einsum string in models/ against this table.
"""
