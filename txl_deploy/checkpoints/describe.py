"""A loaded checkpoint described for people (`txl-deploy info`): format, config, parameters, vocabulary and the
memory one stream needs."""

from __future__ import annotations

from txl_deploy.checkpoints.detect import reader_named
from txl_deploy.model.weights import model_parameters


def describe_checkpoint(loaded) -> dict:
    """What `txl-deploy info` shows of a checkpoint. Builds the model, so every tensor's shape is checked."""
    model = loaded.build()
    cfg = loaded.config
    return {
        "path": loaded.path,
        "format": loaded.source_format,
        "family": reader.family if (reader := reader_named(loaded.source_format)) else None,
        "config": cfg.to_dict(),
        "parameters": model_parameters(model),
        "vocab_size": len(loaded.vocab) if loaded.vocab is not None else None,
        "vocab_kind": loaded.vocab.kind if loaded.vocab is not None else None,
        "vocab_source": loaded.vocab_source,
        "vocab_format": getattr(loaded, "vocab_format", None),
        "vocab_tokenizer": getattr(loaded.vocab, "tokenizer", None) if loaded.vocab is not None else None,
        "vocab_representation": getattr(loaded.vocab, "representation", None) if loaded.vocab is not None else None,
        "memory_bytes_per_stream": {
            "mem_len": cfg.mem_len,
            "fp32": cfg.memory_bytes_per_stream(bytes_per_value=4),
            "fp16": cfg.memory_bytes_per_stream(bytes_per_value=2),
        },
        "notes": list(loaded.notes),
        **({"config_sources": loaded.value_sources} if getattr(loaded, "value_sources", None) else {}),
    }
