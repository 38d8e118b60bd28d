"""The vocabulary's compact symbol table and index read as the list and dict they replace."""

import pytest

from txl_deploy.vocab import Vocab
from txl_deploy.vocab.symbols import SymbolIndex, SymbolTable

SYMBOLS = ["<eos>", "the", "", "Zürich", "\ud800", "日本", "a b", "\x85", "The", "the "]


def test_table_and_index_agree_with_a_list_and_a_dict():
    table = SymbolTable(SYMBOLS)
    index = SymbolIndex(table, SYMBOLS)
    assert len(table) == len(SYMBOLS) and list(table) == SYMBOLS and table == SYMBOLS
    assert [table[i] for i in range(-len(SYMBOLS), len(SYMBOLS))] == SYMBOLS + SYMBOLS
    assert table[2:5] == SYMBOLS[2:5] and table.index("日本") == 5 and "Zürich" in table
    assert dict(index.items()) == {s: i for i, s in enumerate(SYMBOLS)}
    for missing in ("THE", "the  ", "\udc00", 3, None, b"the"):
        assert missing not in index and index.get(missing, -1) == -1
    with pytest.raises(KeyError):
        index["nope"]
    with pytest.raises(IndexError):
        table[len(SYMBOLS)]


def test_a_duplicate_symbol_is_refused():
    with pytest.raises(ValueError, match="duplicate symbol 'Zürich'"):
        Vocab([*SYMBOLS, "Zürich"])


def test_symbols_whose_hashes_collide_are_told_apart(monkeypatch):
    import txl_deploy.vocab.symbols as module

    monkeypatch.setattr(module, "hash", lambda s: len(s), raising=False)  # every symbol of a length collides
    symbols = ["ab", "cd", "ef", "g", "hij"]
    index = SymbolIndex(SymbolTable(symbols))
    assert [index[s] for s in symbols] == [0, 1, 2, 3, 4] and "xy" not in index
    with pytest.raises(ValueError, match="duplicate symbol 'cd'"):
        SymbolIndex(SymbolTable(["ab", "cd", "ef", "cd"]))


def test_a_vocab_round_trips_through_json_with_its_symbols():
    vocab = Vocab(SYMBOLS)
    back = Vocab.from_dict(vocab.to_dict())
    assert back == vocab and back.symbols == SYMBOLS and back.index["the"] == 1


def test_a_vocab_sent_to_another_process_finds_its_ids():
    import pickle
    import subprocess
    import sys

    blob = pickle.dumps(Vocab(SYMBOLS))  # str hashes differ between processes: the index is rebuilt there
    code = ("import pickle, sys; v = pickle.loads(sys.stdin.buffer.read()); "
            "print([v.index.get(s) for s in v.symbols] == list(range(len(v))))")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, check=True,
                         env={**__import__("os").environ, "PYTHONHASHSEED": "random"})
    assert out.stdout.strip() == b"True"
