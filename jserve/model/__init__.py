"""The model families as pure functions over a params pytree (``families/``: one module per
family, keyed by its HF architecture; docs/models.md).

Params layout (``jax.Array`` leaves, dtype = ``ModelConfig.dtype``; matrices stored as
``[in, out]`` so a layer is ``x @ w``), Llama's::

    {
      "embed": [vocab, hidden],
      "layers": [                       # one dict per layer, a Python list
        {"attn_norm": [hidden], "wq": [hidden, n_heads*head_dim],
         "wk": [hidden, n_kv_heads*head_dim], "wv": [hidden, n_kv_heads*head_dim],
         "wo": [n_heads*head_dim, hidden], "mlp_norm": [hidden],
         "w_gate": [hidden, inter], "w_up": [hidden, inter], "w_down": [inter, hidden]},
        ...
      ],
      "final_norm": [hidden],
      "lm_head": [vocab, hidden],       # absent when tie_word_embeddings (embed is used)
    }

Qwen2 layers add "bq" [n_heads*head_dim], "bk"/"bv" [n_kv_heads*head_dim]; Qwen3 layers add
"q_norm"/"k_norm" [head_dim]. Each family's ``layer_tensors`` names the HF tensor of every
leaf: model.embed_tokens.weight -> embed; model.layers.i.input_layernorm -> attn_norm;
self_attn.{q,k,v,o}_proj (transposed) -> wq/wk/wv/wo; post_attention_layernorm -> mlp_norm;
mlp.{gate,up,down}_proj (transposed) -> w_gate/w_up/w_down; model.norm -> final_norm;
lm_head.weight -> lm_head. The two vocabulary matrices keep HF's [vocab, hidden] (the LM
head is a row per token, like the embedding, tied or not): on XLA:CPU the head's product
with the vocabulary on the major side ran 1.4x as fast at 32 rows (``decoder.head_logits``).
"""
