"""One speculative step's mechanics: the draft tree, its verification and acceptance, the KV row stores (their
shared API: `row_store`), logits processing.
"""
