"""What several test folders share: the tiny model, reference models and checkpoint writers, stream helpers.

`tests/` is on sys.path during a test run (pytest's default `prepend` import mode puts the folder of the top
conftest.py there), so every test module imports these as `helpers.<module>`. Test modules never import each
other: what two of them need lives here or in `tests/conftest.py` (fixtures).
"""
