//! Fault injection (filled in below).
