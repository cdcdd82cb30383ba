"""Process supervision: the local and fleet stacks (MLflow, Prefect, PostgreSQL, S3, replicas) and the servers
they start."""
