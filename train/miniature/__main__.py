"""`python -m train.miniature --config train/configs/miniature.yaml --output_dir DIR [--seeds ...]`."""

from train.checks import run_cli
from train.miniature.study import main


if __name__ == "__main__":
    run_cli(main)
