"""The config settings of models that compute differently from the paper's (REMI): `ff_out_relu` and `mem_init`."""

from __future__ import annotations

import pytest

from txl_deploy.config import TxlConfig
from txl_deploy.contract.ring import initial_mem_count
from txl_deploy.errors import TxlError

BASE = dict(n_token=10, n_layer=1, n_head=2, d_model=8, d_head=4, d_inner=16, mem_len=6)


def test_paper_defaults_are_left_out_of_the_dict_and_remis_travel():
    paper = TxlConfig(**BASE)
    # files of every other model (and the fingerprints of their saved states) stay as they were
    assert "ff_out_relu" not in paper.to_dict() and "mem_init" not in paper.to_dict()
    assert TxlConfig.from_json(paper.to_json()) == paper
    remi = paper.replace(ff_out_relu=True, mem_init="zeros", layer_norm_epsilon=1e-3)
    d = remi.to_dict()
    assert (d["ff_out_relu"], d["mem_init"], d["layer_norm_epsilon"]) == (True, "zeros", 1e-3)
    assert TxlConfig.from_json(remi.to_json()) == remi


def test_initial_count_is_mem_len_for_a_zero_memory():
    assert initial_mem_count(TxlConfig(**BASE), 6) == 0
    assert initial_mem_count(TxlConfig(**BASE, mem_init="zeros"), 4) == 4  # the graph's mem_len, not the config's


@pytest.mark.parametrize("bad, fragment", [({"mem_init": "random"}, "mem_init must be one of empty, zeros"),
                                           ({"mem_init": 3}, "mem_init must be a string"),
                                           ({"ff_out_relu": "yes"}, "ff_out_relu must be true or false"),
                                           ({"mem_init": "zeros", "pre_lnorm": True}, "needs pre_lnorm false")])
def test_bad_values_are_refused(bad, fragment):
    with pytest.raises(TxlError, match=fragment):
        TxlConfig(**{**BASE, **bad})
