"""Driving the cluster-factored sampler's decision as the lazy decoder does: start on the head, then reveal each
tail it asks for until it needs none."""

from __future__ import annotations


def decide_lazily(sampler, head, tails):
    """`sampler.start(head)`, revealing `tails[i - 1]` for every tail cluster i it needs; the finished decision."""
    choice = sampler.start(head)
    while choice.needs:
        for i in choice.needs:
            choice.reveal(i, tails[i - 1])
    return choice
