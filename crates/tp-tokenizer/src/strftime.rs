//! A small `strftime` for chat templates (`strftime_now("%d %b %Y")`), in UTC, without a time-zone database.

use std::fmt::Write;

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A UTC calendar time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DateTime {
    pub year: i64,
    /// 1..=12
    pub month: u32,
    /// 1..=31
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    /// 0 = Monday .. 6 = Sunday
    pub weekday: u32,
    /// 1..=366
    pub day_of_year: u32,
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

impl DateTime {
    /// The calendar time `secs` seconds after 1970-01-01 00:00:00 UTC.
    pub fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rest = secs.rem_euclid(86_400) as u32;
        // 1970-01-01 was a Thursday (weekday 3 counting from Monday = 0).
        let weekday = (days + 3).rem_euclid(7) as u32;
        let mut year = 1970i64;
        let mut left = days;
        loop {
            let len = if is_leap(year) { 366 } else { 365 };
            if left < 0 {
                year -= 1;
                left += if is_leap(year) { 366 } else { 365 };
            } else if left >= len {
                left -= len;
                year += 1;
            } else {
                break;
            }
        }
        let day_of_year = left as u32 + 1;
        let mut month = 1u32;
        let mut left = left as u32;
        loop {
            let len = match month {
                2 if is_leap(year) => 29,
                2 => 28,
                4 | 6 | 9 | 11 => 30,
                _ => 31,
            };
            if left < len || month == 12 {
                break;
            }
            left -= len;
            month += 1;
        }
        Self {
            year,
            month,
            day: left + 1,
            hour: rest / 3600,
            minute: rest / 60 % 60,
            second: rest % 60,
            weekday,
            day_of_year,
        }
    }

    /// The current UTC time.
    pub fn now() -> Self {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        Self::from_unix(secs)
    }

    /// Formats with Python's `strftime` directives (%Y %y %m %d %e %H %I %M %S %p %b %B %a %A %j %%,
    /// and `%-d`-style unpadded forms); anything else is copied as written.
    pub fn format(&self, pattern: &str) -> String {
        let mut out = String::new();
        let mut chars = pattern.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let (pad, directive) = match chars.next() {
                Some('-') => (false, chars.next()),
                other => (true, other),
            };
            let num = |out: &mut String, v: u32| {
                let _ = if pad {
                    write!(out, "{v:02}")
                } else {
                    write!(out, "{v}")
                };
            };
            let month = MONTHS[(self.month as usize).saturating_sub(1) % 12];
            let weekday = WEEKDAYS[self.weekday as usize % 7];
            match directive {
                Some('Y') => {
                    let _ = write!(out, "{}", self.year);
                }
                Some('y') => num(&mut out, self.year.rem_euclid(100) as u32),
                Some('m') => num(&mut out, self.month),
                Some('d') => num(&mut out, self.day),
                Some('e') => {
                    let _ = write!(out, "{:>2}", self.day);
                }
                Some('H') => num(&mut out, self.hour),
                Some('I') => num(&mut out, (self.hour + 11) % 12 + 1),
                Some('M') => num(&mut out, self.minute),
                Some('S') => num(&mut out, self.second),
                Some('p') => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                Some('b') => out.push_str(&month[..3]),
                Some('B') => out.push_str(month),
                Some('a') => out.push_str(&weekday[..3]),
                Some('A') => out.push_str(weekday),
                Some('j') => {
                    let _ = if pad {
                        write!(out, "{:03}", self.day_of_year)
                    } else {
                        write!(out, "{}", self.day_of_year)
                    };
                }
                Some('%') => out.push('%'),
                Some(other) => {
                    out.push('%');
                    if !pad {
                        out.push('-');
                    }
                    out.push(other);
                }
                None => out.push('%'),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        let epoch = DateTime::from_unix(0);
        assert_eq!(
            epoch.format("%Y-%m-%d %H:%M:%S %A %j"),
            "1970-01-01 00:00:00 Thursday 001"
        );
        // 2024-02-29 13:05:09 UTC, a Thursday in a leap year.
        let leap = DateTime::from_unix(1_709_211_909);
        assert_eq!(leap.format("%d %b %Y"), "29 Feb 2024");
        assert_eq!(
            leap.format("%a %B %-d, %I:%M %p (%y) %j %%"),
            "Thu February 29, 01:05 PM (24) 060 %"
        );
        // 2000-12-31 23:59:59 UTC: last day of a leap century year.
        assert_eq!(
            DateTime::from_unix(978_307_199).format("%Y-%m-%d %j"),
            "2000-12-31 366"
        );
        // Before the epoch: 1969-12-31 23:59:59, a Wednesday.
        assert_eq!(
            DateTime::from_unix(-1).format("%Y-%m-%d %H %A"),
            "1969-12-31 23 Wednesday"
        );
    }

    #[test]
    fn unknown_directives_are_kept() {
        assert_eq!(DateTime::from_unix(0).format("%Q %-Q 100%"), "%Q %-Q 100%");
    }
}
