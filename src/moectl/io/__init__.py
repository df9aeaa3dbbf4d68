"""Disk and checkpoint I/O, below every other package: atomic writes (``atomic``), byte ranges of
safetensors shards (``range_read``, ``safetensors_index``, ``checkpoint_map``, ``shards``), the page
cache and the cgroup's memory limit (``page_cache``, ``cgroup``), the one ``pip download`` wrapper
(``pip_download``), the one peak-RSS reader (``peak_rss``) and integer arrays as base64 ``.npy``
text (``npy_text``: routed experts on the wire). Nothing here imports another moectl
package except ``moectl.errors``."""
