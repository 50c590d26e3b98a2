"""Tiny models for running sglang-jax's engine on a CPU: built in a folder, nothing downloaded.

Each model is a Hugging Face folder: a ``config.json``, seeded random
float32 weights in one ``model.safetensors`` (written by safetensors' numpy
writer, named and shaped as the architecture's checkpoints are), and a
word-level tokenizer trained on :data:`SENTENCES` (the ``tokenizers``
library, saved with ``transformers``' ``PreTrainedTokenizerFast``). What the
engine needs of them on a CPU: a head dimension of 128 (its CPU attention
pads the KV head dimension to 128).

- :func:`qwen3`: ``Qwen3ForCausalLM``, 2 layers of full attention: the
  engine builds a token or paged allocator.
- :func:`gemma2`: ``Gemma2ForCausalLM``, a sliding layer (window 16) and a
  full one: the engine builds the sliding-window allocator.

Run as a script, ``python -m tests.engine.tiny_models DIR`` writes both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

#: The tokenizer's training text, and the words the tests' prompts are made of.
SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "a page of the cache holds the keys and values of a few tokens",
    "the scheduler frees pages when a request ends and the radix tree keeps its prefix",
    "host memory holds pages the device evicted so that a later request can load them back",
    "one two three four five six seven eight nine ten eleven twelve",
    "red green blue yellow black white orange purple",
)
VOCAB = 128  # the model's embedding rows: at least the tokenizer's words and its special tokens
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 1, 128
LAYERS = 2
WINDOW = 16  # gemma2's sliding window, in tokens


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<pad>", "<s>", "</s>"]
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=specials))
    if tok.get_vocab_size() > VOCAB:
        raise RuntimeError(f"the tokenizer has {tok.get_vocab_size()} tokens, the model {VOCAB} rows")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(folder))


def _save(folder: Path, config: dict[str, object], shapes: dict[str, tuple[int, ...]], seed: int) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)  # RMSNorm scales
        else:
            weights[name] = (rng.standard_normal(shape) * 0.2).astype(np.float32)
    save_file(weights, str(folder / "model.safetensors"))
    _tokenizer(folder)
    return folder


def _common_config(architecture: str, model_type: str) -> dict[str, object]:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "bos_token_id": 2,
        "eos_token_id": 3,
        "pad_token_id": 1,
    }


def _attention_shapes(prefix: str) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        f"{prefix}.input_layernorm.weight": (HIDDEN,),
        f"{prefix}.post_attention_layernorm.weight": (HIDDEN,),
    }


def qwen3(folder: Path, seed: int = 0) -> Path:
    """A 2-layer ``Qwen3ForCausalLM`` in ``folder``: full attention on every layer."""
    config = {**_common_config("Qwen3ForCausalLM", "qwen3"), "tie_word_embeddings": False}
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        shapes |= _attention_shapes(prefix)
        shapes[f"{prefix}.self_attn.q_norm.weight"] = (HEAD_DIM,)
        shapes[f"{prefix}.self_attn.k_norm.weight"] = (HEAD_DIM,)
    return _save(folder, config, shapes, seed)


def gemma2(folder: Path, seed: int = 0) -> Path:
    """A 2-layer ``Gemma2ForCausalLM`` in ``folder``: a sliding-window layer (window 16), then a full one."""
    config = {
        **_common_config("Gemma2ForCausalLM", "gemma2"),
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": HEAD_DIM,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
    }
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        shapes |= _attention_shapes(prefix)
        shapes[f"{prefix}.pre_feedforward_layernorm.weight"] = (HIDDEN,)
        shapes[f"{prefix}.post_feedforward_layernorm.weight"] = (HIDDEN,)
    return _save(folder, config, shapes, seed)


if __name__ == "__main__":
    where = Path(sys.argv[1])
    print(qwen3(where / "qwen3"), gemma2(where / "gemma2"))
