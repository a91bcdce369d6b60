"""AbdomenAtlas 3.0 read from the Hugging Face Hub: listing at a pinned commit, verified downloads, the part ledger, and
the reading of one part pair into the case store.

The only package besides `flows/` that imports the Hub client for downloads; it imports no Prefect and never
`flows` or `train` (import-linter contracts). The endpoint is `HF_ENDPOINT` (default the Hub), the token the usual one
(`HF_TOKEN` or `hf auth login`): against the real Hub and the tests' fake Hub only the endpoint differs.
"""
