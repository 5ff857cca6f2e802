"""What profinfer reads of a process it does not control, and how it reads it safely: files
opened inside the target's own root (`procfs`), the process's facts and mapped files
(`process`), ELF headers, symbols and DWARF (`elfheaders`, `symbols`, `dwarf`), where a probe
goes per instruction set (`arch/`), the parse worker that reads tenants' files off the
daemon's loop (`parsing`, confined by `confine`), and the build cache with its trust checks
(`buildcache`). It imports `base` and `profile`."""
