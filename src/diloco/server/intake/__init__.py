"""Receiving an upload's body on the parameter server: the intake (who may write into a unit's sum
while bytes arrive), the body's header checked and its entries (``upload_body.py``), the upload
slots (``upload_slots.py``), and the round's first upload written into the sum as it arrives
(``first_write.py``).

Hands a landed body to its unit's aggregator (``rounds/``); never imports the web layer or a
front.
"""
