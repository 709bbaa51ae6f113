"""Records: the persistent format of one block (or chunk), its encryption, reading and checking a
record, what a read or write came to, and batch record I/O (the C module and its Python twin)."""
