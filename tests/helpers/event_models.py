"""Tiny models whose vocabularies are music events (REMI's, remi-xl's), for the tests of valid music by
construction: the symbol lists (each with values its writer cannot place, which a grammar must never allow) and a
checkpoint built from the tiny model with an adaptive softmax, so decisions are cluster-factored."""

from __future__ import annotations

from helpers.tiny import make_tiny_model

REMI_SYMBOLS = (["Bar_None"] + [f"Position_{k}/16" for k in range(1, 17)]
                + [f"Note Velocity_{v}" for v in range(10, 22)] + [f"Note On_{p}" for p in range(55, 80)]
                + [f"Note Duration_{d}" for d in range(16)] + ["Chord_C:maj", "Chord_A:min", "Chord_N:N"]
                + [f"Tempo Class_{c}" for c in ("slow", "mid", "fast")] + [f"Tempo Value_{n}" for n in range(12)]
                + ["Note On_200", "Position_17/16"])
REMI_XL_SYMBOLS = (["Bar_None", "EOS_None"] + [f"Beat_{k}" for k in range(16)] + ["Chord_C_M", "Chord_N_N"]
                   + [f"Tempo_{t}" for t in (60, 90, 120, 150)] + [f"Note_Pitch_{p}" for p in range(55, 80)]
                   + [f"Note_Velocity_{v}" for v in range(40, 100, 8)]
                   + [f"Note_Duration_{d}" for d in range(0, 1920, 120)] + ["Chord_broken"])
SYMBOLS = {"remi": REMI_SYMBOLS, "remi-xl": REMI_XL_SYMBOLS}


def save_event_model(folder, representation: str, seed: int = 3):
    """A tiny checkpoint in `folder` whose vocabulary is `representation`'s symbols above; returns the folder."""
    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.vocab import Vocab

    symbols = SYMBOLS[representation]
    save_checkpoint(folder, make_tiny_model(seed, n_token=len(symbols), cutoffs=[12, 40]), Vocab(symbols))
    return folder
