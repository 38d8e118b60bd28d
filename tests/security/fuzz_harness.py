"""The fuzz tests' side of the fuzzing: seed files, Hypothesis strategies that damage them, and the worker process
(fuzz_worker.py) that reads each damaged file under a memory and a time limit.

Seeds are files the test suite makes anyway: the tiny checkpoint (model.safetensors, config.json, vocab.json), its
ONNX export, saved states of it, torch.save files of its state_dict in both formats, a corpus cache pickle,
HuggingFace's TransfoXLTokenizer vocabularies (vocab.pkl as transformers writes it, the plain dict, vocab.bin) and a
TensorFlow bundle. Damage is byte-level (bit flips, truncation, inserted runs, huge varints and 64-bit lengths,
deletions, splices) or structure-aware: fields rewritten inside a valid container whose checksums are recomputed
(the TF index's block crc32c and each entry's data crc32c, zip's CRC-32, safetensors' header length), so that the
damage reaches the parser behind the checksum.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import select
import struct
import subprocess
import sys
import time
import types
import warnings
import zipfile
from pathlib import Path

import mido
import numpy as np
from crafted_files import mask_crc, npy_header, parse_npy, table_bytes, varint, write_bundle
from helpers import remi_xl
from hypothesis import strategies as st

from txl_deploy.checkpoints.tensorflow.bundle import TFCheckpoint, _fields, _varint, crc32c
from txl_deploy.music.events_to_midi import write_midi

HERE = Path(__file__).resolve().parent
HUGE = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


def budget_seconds() -> float:
    """The whole fuzz budget (seconds, all formats together): TXL_FUZZ_SECONDS, 60 by default."""
    return float(os.environ.get("TXL_FUZZ_SECONDS", "60"))


# -- byte-level damage ------------------------------------------------------------------------------------------------
@st.composite
def damaged(draw, data: bytes, region: tuple[int, int] | None = None) -> bytes:
    """`data` with 1 to 4 kinds of damage, at positions inside `region` (default: anywhere)."""
    out = bytearray(data)
    lo, hi = region or (0, len(data))
    for _ in range(draw(st.integers(1, 4))):
        hi_now = min(hi, len(out))
        pos = draw(st.integers(min(lo, hi_now), max(min(lo, hi_now), hi_now)))
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "varint", "u64", "u32", "delete",
                                     "splice"]))
        if kind == "flip" and pos < len(out):
            out[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and pos < len(out):
            out[pos] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x01, draw(st.integers(0, 255))]))
        elif kind == "truncate":
            del out[pos:]
        elif kind == "insert":
            run = draw(st.sampled_from([b"\0", b"\xff", b"\x80", bytes([draw(st.integers(0, 255))])]))
            out[pos:pos] = run * draw(st.integers(1, 4096))
        elif kind == "varint":
            out[pos:pos + draw(st.integers(0, 10))] = varint(draw(st.sampled_from(HUGE)))
        elif kind in ("u64", "u32"):
            width = 8 if kind == "u64" else 4
            value = draw(st.sampled_from(HUGE)) & ((1 << (8 * width)) - 1)
            out[pos:pos + width] = value.to_bytes(width, "little")
        elif kind == "delete":
            del out[pos:pos + draw(st.integers(1, 64))]
        elif kind == "splice" and len(out) > 1:
            start = draw(st.integers(0, len(out) - 1))
            out[pos:pos] = out[start:start + draw(st.integers(1, 256))]
    return bytes(out)


# -- seeds ------------------------------------------------------------------------------------------------------------
def _corpus_pickles() -> list[bytes]:
    """cache.pkl as the original data_utils.py writes it (a Corpus holding a Vocab and numpy splits), protocols 2
    and 4, with the original module names (the classes are made here under those names to be pickled)."""
    data_utils, vocabulary = types.ModuleType("data_utils"), types.ModuleType("vocabulary")
    Corpus = type("Corpus", (), {"__module__": "data_utils"})
    Vocab = type("Vocab", (), {"__module__": "vocabulary"})
    data_utils.Corpus, vocabulary.Vocab = Corpus, Vocab
    saved = {k: sys.modules.get(k) for k in ("data_utils", "vocabulary")}
    sys.modules.update(data_utils=data_utils, vocabulary=vocabulary)
    try:
        vocab = Vocab()
        vocab.idx2sym = [f"w{i}" for i in range(58)] + ["<eos>", "<unk>"]
        vocab.sym2idx = {s: i for i, s in enumerate(vocab.idx2sym)}
        corpus = Corpus()
        corpus.vocab, corpus.dataset = vocab, "wt103"
        corpus.train = np.arange(200, dtype=np.int64) % 60
        return [pickle.dumps(corpus, protocol=p) for p in (2, 4)]
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _tokenizer_vocabularies(folder: Path) -> list[dict]:
    """HuggingFace's TransfoXLTokenizer vocabularies: the vocab.pkl its own save_vocabulary writes (sacremoses
    objects and compiled patterns inside), the older plain-dict layout, and vocab.bin (torch.save) in both formats."""
    import torch  # the vocab.bin seeds
    from transformers.models.deprecated.transfo_xl import TransfoXLTokenizer  # writes the real file (test extra)
    from transformers.utils import logging  # its deprecation warning is not what is fuzzed

    logging.set_verbosity_error()
    words = folder / "hf-words.txt"
    symbols = ["<eos>", "<unk>", "the", "@-@", "@,@", "caf\u00e9", "state-of-the-art"]
    words.write_text("".join(f"{s}\n" for s in symbols), encoding="utf-8")
    out = folder / "hf-vocab"
    out.mkdir()
    tok = TransfoXLTokenizer(vocab_file=str(words), never_split=["state-of-the-art"], lower_case=True)
    (saved,) = tok.save_vocabulary(str(out))
    plain = {k: tok.__dict__[k] for k in ("idx2sym", "sym2idx", "counter", "special", "min_freq", "max_size",
                                          "lower_case", "delimiter", "vocab_file", "never_split", "unk_idx")}
    seeds = [{"vocab.pkl": Path(saved).read_bytes()}, {"vocab.pkl": pickle.dumps(plain, protocol=2)}]
    for legacy in (False, True):
        buf = io.BytesIO()
        torch.save(plain, buf, _use_new_zipfile_serialization=not legacy)
        seeds.append({"vocab.bin": buf.getvalue()})
    return seeds


def _midi_songs(folder: Path) -> list[dict]:
    """Two MIDI songs: one as the REMI writer lays it out (chord markers, tempo changes), one of two instruments at
    96 ticks a beat with running status, note-ons of velocity 0 and a note-off with no note."""
    bar = ["Bar_None", "Position_1/16", "Chord_C:maj", "Position_1/16", "Tempo Class_mid", "Tempo Value_20"]
    notes = [[f"Position_{k}/16", f"Note Velocity_{10 + k}", f"Note On_{48 + 3 * k}", f"Note Duration_{k}"]
             for k in range(1, 17, 3)]
    write_midi((bar + sum(notes, [])) * 3 + ["Bar_None"], "remi", folder / "remi.mid", force=True)
    midi = mido.MidiFile(type=1, ticks_per_beat=96)
    for channel, program in ((0, 0), (1, 33)):
        track = mido.MidiTrack([mido.MetaMessage("set_tempo", tempo=400_000),
                                mido.Message("program_change", channel=channel, program=program)])
        for k in range(12):
            track += [mido.Message("note_on", channel=channel, note=40 + k, velocity=70, time=24),
                      mido.Message("note_on", channel=channel, note=40 + k, velocity=0, time=48)]
        track.append(mido.Message("note_off", channel=channel, note=20, time=5))
        midi.tracks.append(track)
    midi.save(filename=str(folder / "two.mid"))
    return [{"song.mid": (folder / name).read_bytes()} for name in ("remi.mid", "two.mid")]


def _event_dictionaries() -> list[dict]:
    """Music models' event vocabularies: REMI's dictionary.pkl (events with spaces), remi-xl's, and ProgGP's pair."""
    remi = ["Bar_None", "Position_1/16", "Note Velocity_20", "Note On_60", "Note Duration_7", "Chord_C:maj",
            "Tempo Class_mid", "Tempo Value_12"]
    remi_xl = ["Bar_None", "EOS_None", "Beat_0", "Note_Pitch_60", "Note_Velocity_64", "Chord_C_M", "Tempo_120"]
    pairs = [({e: i for i, e in enumerate(events)}, dict(enumerate(events))) for events in (remi, remi_xl)]
    proggp = ["wait:240", "new_measure", "drums:note:36", "artist:zz_top"]
    return [{"dictionary.pkl": pickle.dumps(pairs[0], protocol=2)}, {"dictionary.pkl": pickle.dumps(pairs[1])},
            {"vocab_song_artist.pkl": pickle.dumps({e: i for i, e in enumerate(proggp)}, protocol=3),
             "rev_vocab_song_artist.pkl": pickle.dumps(dict(enumerate(proggp)), protocol=3)}]


def make_seeds(tiny_ckpt: Path, tiny_onnx: Path, folder: Path) -> dict:
    """{format: [seed, ...]}; a seed is {file name: bytes} (or, for states, the state's arrays too)."""
    import torch  # the torch.save seeds

    from txl_deploy.checkpoints import load_model
    from txl_deploy.exporters.onnx.ort_format import write_ort_format
    from txl_deploy.runtimes import TxlRuntime

    ckpt = {name: (tiny_ckpt / name).read_bytes() for name in ("config.json", "model.safetensors", "vocab.json")}
    seeds = {"checkpoint": [ckpt], "onnx": [{"model.onnx": tiny_onnx.read_bytes()}]}
    ort_folder = folder / "ort"  # the .ort of the tiny graph, as export --ort-format writes it
    ort_folder.mkdir(parents=True, exist_ok=True)
    (ort_folder / "model.onnx").write_bytes(tiny_onnx.read_bytes())
    seeds["ort"] = [{"model.ort": write_ort_format(ort_folder / "model.onnx").path.read_bytes()}]
    states = []
    with TxlRuntime.load(tiny_onnx) as rt:
        for prompt in ([[5, 17, 42]], [[1] * 20], [[3], [4]]):
            rt.reset()
            rt.step(prompt)
            states.append(rt.save_state())
    states.append({**states[0], "__format__": np.array("txl-deploy conversation state"),
                   "__format_version__": np.array(1), "__sequence_id__": np.array(7, np.int64)})
    seeds["state"] = []
    for i, arrays in enumerate(states):
        buf = io.BytesIO()
        (np.savez_compressed if i == 1 else np.savez)(buf, **arrays)
        seeds["state"].append({"state.npz": buf.getvalue()})
    state_dict = {k: v.clone() for k, v in load_model(tiny_ckpt).state_dict.items()}
    seeds["torch"] = []
    for legacy in (False, True):
        buf = io.BytesIO()
        torch.save(state_dict, buf, _use_new_zipfile_serialization=not legacy)
        seeds["torch"].append({"model.pt": buf.getvalue()})
    seeds["midi"] = _midi_songs(folder)
    seeds["remi-xl"] = []
    for with_setting in (True, False):  # without model_setting, the run's config.yml beside it is read
        remi_folder = folder / f"remi-xl-{with_setting}"
        remi_folder.mkdir()
        remi_xl.save_pth_tar(remi_folder / "ep_1.pth.tar", remi_xl.state_dict(), with_model_setting=with_setting)
        if not with_setting:
            remi_xl.write_config_yml(remi_folder)
        seeds["remi-xl"].append({p.name: p.read_bytes() for p in remi_folder.iterdir()})
    seeds["cache"] = [{"cache.pkl": p} for p in _corpus_pickles()]
    seeds["tokenizer-vocab"] = _tokenizer_vocabularies(folder)
    seeds["event-vocab"] = _event_dictionaries()
    prefix = folder / "tf" / "model.ckpt-0"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_bundle(prefix, {"transformer/r_w_bias": rng.normal(size=(2, 2, 8)).astype(np.float32),
                          "transformer/layer_0/ff/layer_1/kernel": rng.normal(size=(32, 64)).astype(np.float32),
                          "global_step": np.array(1000, np.int64)})
    seeds["tf"] = [{"model.ckpt-0.index": prefix.with_suffix(".ckpt-0.index").read_bytes(),
                    "model.ckpt-0.data-00000-of-00001":
                        Path(f"{prefix}.data-00000-of-00001").read_bytes()}]
    return seeds


# -- structure-aware damage -------------------------------------------------------------------------------------------
def _table_rows(index: bytes) -> list[tuple[bytes, bytes]]:
    """(key, value) rows of a valid TF index, read with the bundle reader's own table functions."""
    reader = TFCheckpoint.__new__(TFCheckpoint)  # its table methods need no file
    footer, pos = index[-48:], 0
    for _ in range(2):  # the metaindex handle
        _, pos = _varint(footer, pos)
    offset, pos = _varint(footer, pos)
    size, _ = _varint(footer, pos)
    rows = []
    for _, handle in reader._block_entries(reader._block(index, offset, size)):
        o, p = _varint(handle, 0)
        s, _ = _varint(handle, p)
        rows += list(reader._block_entries(reader._block(index, o, s)))
    return [(bytes(k), bytes(v)) for k, v in rows]


def _entry_fields(value: bytes) -> list[tuple[int, int, object]]:
    return _fields(value)


def _encode_fields(fields) -> bytes:
    out = bytearray()
    for number, wire, value in fields:
        out += varint(number << 3 | wire)
        if wire == 0:
            out += varint(value & 0xFFFFFFFFFFFFFFFF)
        elif wire == 1:
            out += struct.pack("<Q", value & 0xFFFFFFFFFFFFFFFF)
        elif wire == 5:
            out += struct.pack("<I", value & 0xFFFFFFFF)
        else:
            out += varint(len(value)) + value
    return bytes(out)


@st.composite
def tf_structured(draw, seed: dict) -> dict:
    """The bundle with index entries rewritten (dtype, shape, shard, offset, size, header fields, raw value bytes)
    and the table's block checksums recomputed; or a shard byte changed with its entry's crc32c recomputed."""
    index, shard = seed["model.ckpt-0.index"], seed["model.ckpt-0.data-00000-of-00001"]
    rows = _table_rows(index)
    shard = bytearray(shard)
    i = draw(st.integers(0, len(rows) - 1))
    key, value = rows[i]
    choice = draw(st.sampled_from(["field", "raw value", "key", "shard", "drop", "duplicate"]))
    if choice == "field":
        fields = _entry_fields(value)
        number = draw(st.integers(1, 8))
        new = draw(st.one_of(st.sampled_from(HUGE), st.integers(0, 64), st.just(-1 & 0xFFFFFFFFFFFFFFFF)))
        if key and number == 2:  # the shape: dims of any size, any count
            dims = draw(st.lists(st.one_of(st.sampled_from(HUGE), st.integers(-2, 64)), max_size=40))
            value = _encode_fields([f for f in fields if f[0] != 2] + [
                (2, 2, b"".join(_encode_fields([(2, 2, _encode_fields([(1, 0, d)]))]) for d in dims))])
        else:
            value = _encode_fields([f for f in fields if f[0] != number] + [(number, 0 if number != 6 else 5, new)])
    elif choice == "raw value":
        value = draw(damaged(value))
    elif choice == "key":
        key = draw(st.sampled_from([b"", b"\xff\xfe", key + b"\0", "é".encode(), key * 50]))
    elif choice == "shard" and shard:
        pos = draw(st.integers(0, len(shard) - 1))
        shard[pos] ^= 0xFF
        for j, (k, v) in enumerate(rows):
            if not k:
                continue
            fields = _entry_fields(v)
            f = {n: val for n, _, val in fields}
            start, size = f.get(4, 0), f.get(5, 0)
            if start <= pos < start + size:
                crc = mask_crc(crc32c(bytes(shard[start:start + size])))
                rows[j] = (k, _encode_fields([x for x in fields if x[0] != 6] + [(6, 5, crc)]))
    elif choice == "drop":
        rows.pop(i)
    rows = rows if choice in ("drop", "shard") else rows[:i] + [(key, value)] + rows[i + 1:]
    if choice == "duplicate":
        rows.insert(i, rows[i])
    return {"model.ckpt-0.index": table_bytes(sorted(rows) if draw(st.booleans()) else rows),
            "model.ckpt-0.data-00000-of-00001": bytes(shard)}


@st.composite
def npz_structured(draw, seed: bytes) -> bytes:
    """A saved state re-zipped (valid CRC-32s) with one member's .npy header rewritten, its data cut or grown, a
    member renamed, dropped or duplicated, or its compression changed."""
    z = zipfile.ZipFile(io.BytesIO(seed))
    members = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    i = draw(st.integers(0, len(members) - 1))
    name, data = members[i]
    choice = draw(st.sampled_from(["shape", "descr", "fortran", "data", "name", "drop", "duplicate", "header"]))
    head, body = parse_npy(data)
    if choice == "shape":
        shape = draw(st.lists(st.one_of(st.sampled_from(HUGE), st.integers(-1, 40)), max_size=6))
        data = npy_header(shape, head["descr"]) + body
    elif choice == "descr":
        data = npy_header(head["shape"], draw(st.sampled_from(["<f8", "<f2", "|O", "<U64", "|b1", "<i4", "V16",
                                                                "<c8", "S3", ">f4"]))) + body
    elif choice == "fortran":
        data = npy_header(head["shape"], head["descr"], fortran=True) + body
    elif choice == "data":
        data = data[: draw(st.integers(0, len(data)))] + bytes(draw(st.integers(0, 300)))
    elif choice == "name":
        name = draw(st.sampled_from(["../x.npy", "/abs.npy", "mem_k.0", "__fingerprint__.npy", "a" * 300,
                                     "mem_count.npy", name + ".npy"]))
    elif choice == "header":
        data = draw(damaged(data, (0, 128)))
    members[i] = (name, data)
    if choice == "drop":
        members.pop(i)
    elif choice == "duplicate":
        members.append(members[i])
    buf = io.BytesIO()
    method = draw(st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA]))
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w", method) as out:
        warnings.simplefilter("ignore")  # a duplicate member is the point
        for n, d in members:
            out.writestr(n, d)
    return buf.getvalue()


@st.composite
def torch_zip_structured(draw, seed: bytes) -> bytes:
    """A zip-format torch.save file re-zipped (valid CRC-32s, which torch's reader checks) with its data.pkl
    damaged, or a data record cut or dropped (when it has any)."""
    z = zipfile.ZipFile(io.BytesIO(seed))
    members = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    pkl = next(j for j, (n, _) in enumerate(members) if n.endswith("data.pkl"))
    records = [j for j, (n, _) in enumerate(members) if "/data/" in n]
    if not records or draw(st.booleans()):  # a file of no tensors (vocab.bin) has only its data.pkl to damage
        members[pkl] = (members[pkl][0], draw(damaged(members[pkl][1])))
    else:
        j = draw(st.sampled_from(records))
        if draw(st.booleans()):
            members.pop(j)
        else:
            members[j] = (members[j][0], members[j][1][: draw(st.integers(0, len(members[j][1])))])
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as out:
        for n, d in members:
            out.writestr(n, d)
    return buf.getvalue()


JSON_VALUES = st.one_of(st.none(), st.booleans(), st.sampled_from([0, -1, 1, 2**31, 2**40, 2**63, 10**400]),
                        st.floats(allow_nan=True), st.text(max_size=20), st.just([]), st.just({}),
                        st.lists(st.integers(-5, 2**40), max_size=5))


@st.composite
def json_structured(draw, data: bytes) -> bytes:
    """A JSON file with a value replaced (any type, huge or negative numbers), a key dropped or added, or nested
    deeply; re-serialised."""
    doc = json.loads(data)
    target = doc.get("config", doc) if isinstance(doc, dict) else doc
    choice = draw(st.sampled_from(["replace", "drop", "add", "root", "deep"]))
    if choice == "root":
        return json.dumps(draw(JSON_VALUES)).encode()
    if choice == "deep":
        depth = draw(st.integers(1, 100000))
        return b"[" * depth + b"]" * depth
    if isinstance(target, dict) and target:
        key = draw(st.sampled_from(sorted(target)))
        if choice == "replace":
            target[key] = draw(JSON_VALUES)
        elif choice == "drop":
            del target[key]
        else:
            target[draw(st.text(max_size=10))] = draw(JSON_VALUES)
    elif isinstance(target, list) and target:
        target[draw(st.integers(0, len(target) - 1))] = draw(JSON_VALUES)
    return json.dumps(doc, allow_nan=True).encode()


@st.composite
def safetensors_structured(draw, data: bytes) -> bytes:
    """A safetensors file with a header value rewritten (dtype, shape, offsets), keeping the length prefix true."""
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    name = draw(st.sampled_from(sorted(header)))
    if name == "__metadata__":
        header[name] = draw(JSON_VALUES)
    else:
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        if field == "dtype":
            header[name][field] = draw(st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F64", "XX", ""]))
        else:
            header[name][field] = draw(st.lists(st.one_of(st.sampled_from(HUGE), st.integers(-2, 100)), max_size=4))
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


# -- Triton requests --------------------------------------------------------------------------------------------------
@st.composite
def triton_calls(draw, parked_states: list[bytes]) -> list:
    """execute() calls of requests with any shapes and values for tokens and out_positions, any START/END flags and
    conversation ids (the canary's excepted), resume_state bytes from parked states (damaged or not), tail_clusters
    of any shape and value, and any of the outputs asked for (the head, tails, the full log-probs, the state)."""
    calls = []
    for _ in range(draw(st.integers(1, 4))):
        call = []
        for _ in range(draw(st.integers(1, 4))):
            r = {"corrid": draw(st.integers(1, 5)), "start": draw(st.booleans()), "end": draw(st.booleans()),
                 "want_state": draw(st.booleans())}
            raw = {}
            for name in ("tokens", "out_positions"):
                shape = draw(st.sampled_from([(1, 1), (1, 3), (1, 0), (1, 16), (1, 17), (2, 2), (3,), (), (1, 1, 1),
                                              (1, 300)]))
                dtype = draw(st.sampled_from([np.int64, np.int64, np.int64, np.int32, np.float32, np.uint64]))
                values = draw(st.sampled_from(["small", "any", "edge"]))
                size = int(np.prod(shape))
                if values == "small":
                    ints = draw(st.lists(st.integers(0, 59), min_size=size, max_size=size))
                elif values == "any":
                    ints = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=size, max_size=size))
                else:
                    ints = [draw(st.sampled_from([-1, 60, 2**62, -(2**63), 16, 0]))] * size
                if draw(st.integers(0, 9)):  # mostly present
                    raw[name] = np.array(ints, dtype=np.int64).astype(dtype).reshape(shape)
            if draw(st.integers(0, 2)) == 0:  # lazy decoding: tails of the latest distribution
                shape = draw(st.sampled_from([(1, 1), (1, 2), (1, 3), (1, 0), (2, 1), (1,), ()]))
                dtype = draw(st.sampled_from([np.int64, np.int64, np.int32, np.float32, np.uint64, np.bool_]))
                ints = draw(st.lists(st.sampled_from([1, 2, 0, 3, -1, 2**62, -(2**63)]), min_size=int(np.prod(shape)),
                                     max_size=int(np.prod(shape))))
                raw["tail_clusters"] = np.array(ints, dtype=np.int64).astype(dtype).reshape(shape)
            r["outputs"] = draw(st.sampled_from([None, ["head_log_probs"], ["tail_log_probs"],
                                                 ["log_probs", "head_log_probs", "tail_log_probs", "saved_state"]]))
            if draw(st.integers(0, 3)) == 0 and parked_states:
                blob = draw(st.sampled_from(parked_states))
                if draw(st.booleans()):
                    blob = draw(damaged(blob))
                raw["resume_state"] = np.frombuffer(blob, np.uint8)[None].copy()
            r["raw"] = raw
            call.append(r)
        calls.append(call)
    return calls


# -- the worker -------------------------------------------------------------------------------------------------------
class Worker:
    """fuzz_worker.py in a subprocess; `run(case)` -> its answer, or {"status": "hang"/"crash"} (then restarted)."""

    def __init__(self, onnx_path, config_path, triton_repo=None, case_timeout: float = 30.0, spare_mb: int = 512):
        self.args = [sys.executable, str(HERE / "fuzz_worker.py"), "--onnx", str(onnx_path), "--config",
                     str(config_path), "--spare-mb", str(spare_mb)]
        if triton_repo is not None:
            self.args += ["--triton-repo", str(triton_repo)]
        self.case_timeout = case_timeout
        self.proc = None
        self.cases = 0
        self.start()

    def start(self):
        paths = [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]  # this folder and tests/ (helpers)
        # One malloc arena: glibc reserves 64 MB of address space for each thread's own arena, and short-lived
        # library threads would spend the worker's address-space limit as if a case had allocated it.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "MALLOC_ARENA_MAX": "1"}
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        line = self._line(300)
        if line is None or not json.loads(line).get("ready"):
            raise RuntimeError("the fuzz worker did not start")

    def _line(self, timeout):
        deadline = time.monotonic() + timeout
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return None
            buf += chunk
        return buf.decode()

    def run(self, case: dict) -> dict:
        payload = pickle.dumps(case)
        self.cases += 1
        try:
            self.proc.stdin.write(struct.pack("<Q", len(payload)) + payload)
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = self._line(self.case_timeout)
        if line is not None:
            return json.loads(line)
        alive = self.proc.poll() is None
        answer = {"status": "hang" if alive else "crash", "error": f"the worker {'hung' if alive else 'died'}",
                  "message": f"over {self.case_timeout} s" if alive else f"exit code {self.proc.returncode}"}
        self.stop()
        self.start()
        return answer

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()
