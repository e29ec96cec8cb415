"""One speculative step's mechanics: the draft tree, its verification and acceptance, the KV row stores, logits
processing.
"""
