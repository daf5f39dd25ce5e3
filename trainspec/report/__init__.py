"""Reports over metrics files (`trainspec report`): a table and HTML plots, whichever
implementation wrote the records. Framework-free (matplotlib only)."""
