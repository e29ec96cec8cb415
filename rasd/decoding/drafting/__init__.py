"""Draft-tree builders and draft stores shared by proposers: RASD fusion, OPT-Tree, the response history.
"""
