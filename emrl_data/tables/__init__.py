"""Tables and publishing: schemas, Parquet shards, table folders, the SFT set, the RL hard set, QA and the dataset card."""
