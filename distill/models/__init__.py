"""Model references (folders, hub ids, built-in aliases) and draft construction."""
