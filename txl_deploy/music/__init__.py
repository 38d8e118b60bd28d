"""Symbolic music: the event representations of the Transformer-XLs people make music with (REMI, remi-xl), and
what goes with them. docs/music.md says how each is read, generated and written."""

from txl_deploy.music.generation import generate_music

__all__ = ["generate_music"]
