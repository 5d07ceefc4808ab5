"""What runs inside an allocation: the sbatch wrapper and the runner."""
