"""A table folder published as a versioned release, without Prefect: the local folder target (`publishing.local`) and
the read-back both targets end with (`publishing.readback`).

The `publish-dataset` flow (`flows/publish.py`) and its Hub target (`flows/publish_hub.py`, whose network retries are
Prefect tasks) call it; it never imports `flows`, the CLI, `train` or Prefect. The release's plan is pure
(`emrl_data/tables/table_folder.py`).
"""
