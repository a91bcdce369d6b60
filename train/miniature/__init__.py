"""The paper's experiment in miniature on CPU (`python -m train.miniature`, `make miniature`)."""
