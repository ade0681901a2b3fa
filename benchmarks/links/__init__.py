"""Workers behind links of their own: a shaping proxy per worker (``slow_links``), and real
shaped links between network namespaces (``netns_links``, root only; ``netns`` builds them)."""
