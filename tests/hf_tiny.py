"""What the HF tests share: the ZeRO-3 config dict HF's examples use (with or without `"z3ext"`), a tiny Llama
config, a character tokenizer built locally (no downloads), and whether an engine runs z3ext."""

CHARS = "abcdefghijklmnopqrstuvwxyz .,!?"
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]


def hf_zero3_config(z3ext, persistence="auto", zero_extra=None, extra=None):
    # "auto" as in HF's ZeRO-3 example config: the Trainer fills in 10 * hidden_size (norm weights
    # persistent, every Linear and the embeddings partitioned) and the bucket sizes from the model.
    zero = {"stage": 3, "stage3_param_persistence_threshold": persistence, "stage3_prefetch_bucket_size": "auto",
            "reduce_bucket_size": "auto"}
    zero.update(zero_extra or {})
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if z3ext:
        cfg["z3ext"] = z3ext
    cfg.update(extra or {})
    return cfg


def tiny_llama_config(vocab_size=128, hidden_size=64, **overrides):
    """A 2-layer Llama in fp32, untied embeddings, built from a config (no downloads)."""
    from transformers import LlamaConfig
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
              use_cache=False, dtype="float32")
    kw.update(overrides)
    return LlamaConfig(**kw)


def char_tokenizer():
    """One token per character of CHARS, plus pad/bos/eos/unk; decodes by concatenation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIAL + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def z3ext_engaged(engine):
    opt = getattr(engine, "optimizer", engine)
    return hasattr(getattr(opt, "parameter_offload", opt), "z3ext")
