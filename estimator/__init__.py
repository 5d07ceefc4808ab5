"""What a job needs and how fast it runs: models, GPUs, clusters, memory, communication,
compute, stage partitioning, Cells and their estimates."""
