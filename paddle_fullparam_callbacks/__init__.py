"""Full-parameter Hugging Face snapshots of PaddlePaddle models while they train."""
