"""Test stand-in for NVIDIA DeepLearningExamples `PyTorch/LanguageModeling/Transformer-XL/pytorch/utils/`."""
