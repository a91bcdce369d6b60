"""Tables and publishing: schemas, Parquet shards, the SFT set, hard-case mining, QA and the dataset card."""
