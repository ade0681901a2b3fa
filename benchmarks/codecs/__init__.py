"""The codecs: encode and decode speed on one core (``speed``), their relative error on
pseudo-gradient-like data (``error``), and training loss against bytes per round (``quality``)."""
