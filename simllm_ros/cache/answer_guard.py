"""Veto for the ANSWER tier: may a cached answer be returned for a new, similar question?

Why it exists: sentence embeddings put "is Elm Street open" and "is Elm Street
closed", or "alarm at 3 pm" and "alarm at 5 pm", very close together, yet the
right answers differ. Returning a stored answer is only safe when the two
questions agree on everything that changes the answer. This module compares
the details embeddings blur, with explicit rules that can be read and tested:

  negation      not, no, never, n't, without, ... (count must match)
  opposites     open/closed, on/off, start/stop, lock/unlock, ... (one side each)
  numbers       digits, number words, ordinals, times (3 pm == 15:00), percentages
  units         currency and measures, and which number each one belongs to
  dates         weekdays, months, today/tomorrow/tonight, next/last week, holidays
  entities      capitalized words past the sentence start, tokens mixing letters
                and digits (flight ua123)
  places        lowercase words after in/at/to/from/near/for/... ("weather in
                tampa" vs "weather in orlando"); a crude stand-in for named
                entities in lowercase speech-to-text output
  quotes        quoted text ('how do i say "hotel"') must match

It is deliberately conservative: when unsure it refuses, which only costs a
normal model run. It cannot catch a difference in plain content words ("say
hello in french" vs "say goodbye in french"); the high ANSWER similarity
threshold has to cover those.
"""
from __future__ import annotations

import collections
import re
import unicodedata
from decimal import Decimal, InvalidOperation

from simllm_ros.validation import normalize_text

# ---------------------------------------------------------------- word lists

NEGATIONS = {"not", "no", "never", "without", "none", "nobody", "nothing", "nowhere", "neither", "nor",
             "cannot", "cant", "dont", "doesnt", "didnt", "isnt", "arent", "wasnt", "werent", "wont",
             "wouldnt", "shouldnt", "couldnt", "havent", "hasnt", "hadnt", "aint", "mustnt", "neednt"}

# Pairs of opposite word groups; a question using only one side and another
# using only the other side ask different things.
OPPOSITES: tuple[tuple[frozenset, frozenset], ...] = tuple((frozenset(a.split()), frozenset(b.split())) for a, b in (
    ("open opens opened opening reopen", "closed close closes closing shut"),
    ("on", "off"),
    ("start starts started starting begin begins beginning", "stop stops stopped stopping end ends finish"),
    ("enable enabled enabling activate activated", "disable disabled disabling deactivate deactivated"),
    ("increase increases increased increasing", "decrease decreases decreased decreasing reduce"),
    ("raise raised", "lower lowered"),
    ("higher highest high", "lower lowest low"),
    ("up", "down"),
    ("louder", "quieter softer"),
    ("before", "after"),
    ("lock locks locked locking", "unlock unlocks unlocked unlocking"),
    ("yes", "no"),
    ("add adds added adding", "remove removes removed removing delete deleted deleting"),
    ("book booked booking reserve reserved", "cancel cancels canceled cancelled cancelling canceling"),
    ("buy buying bought", "sell selling sold"),
    ("arrive arrives arrival arriving", "depart departs departure departing leave leaves leaving"),
    ("left", "right"),
    ("true", "false"),
    ("hot hotter hottest", "cold colder coldest"),
    ("warm warmer", "cool cooler"),
    ("max maximum most", "min minimum least"),
    ("first", "last"),
    ("earliest", "latest"),
    ("early earlier", "late later"),
    ("north northern", "south southern"),
    ("east eastern", "west western"),
    ("push", "pull"),
    ("send sent", "receive received"),
    ("win won winning", "lose lost losing"),
    ("include included", "exclude excluded"),
    ("above", "below"),
    ("inside indoors", "outside outdoors"),
    ("more", "less fewer"),
    ("plus", "minus"),
    ("connect connected", "disconnect disconnected"),
    ("mute muted", "unmute unmuted"),
    ("pause paused", "resume resumed unpause"),
    ("show", "hide"),
    ("allow allowed", "deny denied block blocked"),
    ("accept accepted", "reject rejected decline declined"),
    ("upload uploaded", "download downloaded"),
    ("import", "export"),
    ("entrance", "exit"),
    ("full", "empty"),
    ("fast faster fastest", "slow slower slowest"),
    ("cheap cheaper cheapest", "expensive"),
    ("best", "worst"),
    ("in", "out"),
))

NUMBER_WORDS = {w: (i, "unit") for i, w in enumerate("zero one two three four five six seven eight nine".split())}
NUMBER_WORDS.update({w: (i + 10, "teen") for i, w in enumerate(
    "ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split())})
NUMBER_WORDS.update({w: (10 * (i + 2), "tens") for i, w in enumerate(
    "twenty thirty forty fifty sixty seventy eighty ninety".split())})
NUMBER_WORDS.update({"hundred": (100, "scale"), "thousand": (1000, "scale"), "million": (10**6, "scale"),
                     "billion": (10**9, "scale")})

ORDINAL_WORDS = {w: i + 1 for i, w in enumerate(
    "first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth fourteenth "
    "fifteenth sixteenth seventeenth eighteenth nineteenth twentieth".split())}
ORDINAL_WORDS.update({"thirtieth": 30, "fortieth": 40, "fiftieth": 50, "hundredth": 100})

# words before "one" that make it a pronoun ("which one"), not a number
_ONE_PRONOUN_BEFORE = set("the this that which each every any another no some good favorite favourite best "
                          "last next other only new big little right wrong".split())

# unit word -> canonical unit. Plural forms are listed explicitly.
_UNIT_GROUPS = {
    "usd": "dollar dollars buck bucks usd $", "eur": "euro euros eur €", "gbp": "gbp quid sterling £",
    "pound": "pound pounds", "jpy": "yen jpy ¥", "cny": "yuan rmb cny renminbi", "peso": "peso pesos mxn",
    "inr": "rupee rupees inr ₹", "rub": "ruble rubles rouble roubles rub", "krw": "won krw",
    "franc": "franc francs chf", "lira": "lira lire", "krona": "krona kronor krone kroner sek nok dkk",
    "cad": "cad", "aud": "aud", "btc": "bitcoin bitcoins btc", "cent": "cent cents penny pennies",
    "baht": "baht", "dirham": "dirham dirhams", "dinar": "dinar dinars", "shekel": "shekel shekels",
    "minute": "minute minutes mins", "hour": "hour hours hrs", "second": "seconds secs",
    "mile": "mile miles", "km": "km kilometer kilometers kilometre kilometres kms",
    "meter": "meter meters metre metres", "feet": "feet ft", "inch": "inch inches", "yard": "yard yards",
    "cm": "cm centimeter centimeters centimetre centimetres", "mm": "mm millimeter millimeters",
    "kg": "kg kgs kilo kilos kilogram kilograms", "gram": "gram grams", "lb": "lb lbs",
    "ounce": "ounce ounces oz", "ton": "ton tons tonne tonnes", "liter": "liter liters litre litres",
    "ml": "ml milliliter milliliters millilitre millilitres", "gallon": "gallon gallons gal",
    "quart": "quart quarts", "pint": "pint pints", "cup": "cup cups", "tbsp": "tablespoon tablespoons tbsp",
    "tsp": "teaspoon teaspoons tsp", "degree": "degree degrees °", "celsius": "celsius centigrade",
    "fahrenheit": "fahrenheit", "kelvin": "kelvin", "mph": "mph", "kph": "kph kmh",
    "byte": "byte bytes", "kb": "kb", "mb": "mb", "gb": "gb", "tb": "tb",
    "calorie": "calorie calories kcal", "watt": "watt watts kw kwh", "volt": "volt volts",
}
UNIT_WORDS = {w: canon for canon, words in _UNIT_GROUPS.items() for w in words.split()}
# Short or ambiguous unit words: a unit only right after a number ("5 m", "on foot" is not a unit).
BOUND_UNIT_WORDS = {"m": "meter", "g": "gram", "l": "liter", "s": "second", "h": "hour", "min": "minute",
                    "hr": "hour", "sec": "second", "mi": "mile", "c": "celsius", "f": "fahrenheit",
                    "foot": "feet", "second": "second", "k": "thousand", "cal": "calorie",
                    "day": "day", "days": "day", "week": "week", "weeks": "week", "month": "month",
                    "months": "month", "year": "year", "years": "year", "night": "night", "nights": "night"}

WEEKDAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
MONTHS = "january february march april may june july august september october november december".split()
_MONTH_ABBR = {"jan": "january", "feb": "february", "mar": "march", "apr": "april", "jun": "june",
               "jul": "july", "aug": "august", "sep": "september", "sept": "september", "oct": "october",
               "nov": "november", "dec": "december"}
_AMBIGUOUS_MONTHS = {"may", "march", "mar", "jan", "dec", "sep", "oct", "nov", "aug", "jun", "jul", "apr", "feb"}
_MONTH_CONTEXT = {"in", "of", "early", "late", "mid", "next", "last", "this", "since", "until", "till", "during"}
RELATIVE_TIME = {"today": "today", "tonight": "tonight", "tonite": "tonight", "tomorrow": "tomorrow",
                 "tmrw": "tomorrow", "tomorrows": "tomorrow", "yesterday": "yesterday", "yesterdays": "yesterday",
                 "todays": "today", "weekend": "weekend", "weekends": "weekend", "weekday": "weekday",
                 "weekdays": "weekday", "morning": "morning", "mornings": "morning", "afternoon": "afternoon",
                 "evening": "evening", "evenings": "evening", "night": "night", "nights": "night",
                 "overnight": "overnight", "day": "day", "week": "week", "weeks": "week", "month": "month",
                 "months": "month", "year": "year", "years": "year", "fortnight": "fortnight",
                 "christmas": "christmas", "xmas": "christmas", "easter": "easter",
                 "thanksgiving": "thanksgiving", "halloween": "halloween", "hanukkah": "hanukkah",
                 "valentines": "valentines", "valentine": "valentines"}
_TIME_MODIFIERS = {"next", "last", "this", "coming", "previous", "past"}
_TIMES_OF_DAY = {"noon": "t:12:00", "midday": "t:12:00", "midnight": "t:00:00"}

# place/target prepositions for the lowercase "places" check ("to" is handled apart)
_PLACE_PREPS = {"in", "at", "from", "near", "for", "into", "towards", "toward", "via", "between", "on", "by",
                "about", "around", "across", "through", "onto", "inside", "outside", "within"}
_TO_AFTER = set("get go going goes went way drive driving drove route routes directions direction distance travel "
                "traveling travelling trip flight flights fly flying bus train ride walk walking head heading "
                "commute commuting take back move moving ship shipping translate translated convert converted "
                "far close closest nearest next closer".split())
_DETERMINERS = set("the a an my your our their his her its this that these those some any".split())
_PHRASAL_ON = set("turn turned switch switched put log logged sign signed carry hold keep come going go "
                  "move check based depend depends rely focus".split())
STOPWORDS = set("""
a about above after again against all am an and any are as at be because been before being below between both
but by can could did do does doing down during each few for from further had has have having he her here hers
herself him himself his how i if in into is it its itself just me more most my myself nor of off on once only or
other our ours ourselves out over own same she should so some such than that the their theirs them themselves then
there these they this those through to too under until up very was we were what when where which while who whom
why will with would you your yours yourself yourselves whats what's it's i'm i'd i'll i've you're you've you'd
you'll there's that's here's let's im id ill ive youre thats theres lets whos who's hows how's wheres where's
please thanks thank hi hey hello ok okay sure yes yeah also like well just really actually now then soon later
anything something everything nothing someone anyone everyone somebody anybody one ones thing things stuff
want wanna need needs gotta know tell say said get got give go going make made let see look find use call called
think take put set help show check like love able
much many lot lots alot kind sort type way ways time times
""".split())


# ---------------------------------------------------------------- tokenizing

_TOKEN_RE = re.compile(r"\d+(?:,\d{3})+(?:\.\d+)?|\d+(?:[.:]\d+)?|[^\W\d_]+(?:'[^\W\d_]+)*|[$€£¥₹%°]")
_SENTENCE_END_RE = re.compile(r"[.!?\n]")
_DIGIT_RE = re.compile(r"\d")
_MIXED_RE = re.compile(r"[^\W_]+(?:-[^\W_]+)*")
_NUMBER_SUFFIX_RE = re.compile(r"^\d+(?:st|nd|rd|th|am|pm|s|k|m|g|h|l|c|f)?$")


def _prepare(text: str) -> str:
    t = unicodedata.normalize("NFKC", normalize_text(text))
    t = t.replace("\u2019", "'").replace("\u2018", "'").replace("\u201c", '"').replace("\u201d", '"')
    t = re.sub(r"\b([ap])\.\s?m\.(?=\s|$|[,;!?])", r"\1m", t, flags=re.IGNORECASE)
    return t


def _tokens_with_case(text: str) -> list[tuple[str, str, bool]]:
    """(lowercase token, original token, at sentence start)."""
    out: list[tuple[str, str, bool]] = []
    last_end = 0
    for m in _TOKEN_RE.finditer(text):
        tok = m.group(0)
        start = not out or _SENTENCE_END_RE.search(text, last_end, m.start()) is not None
        out.append((tok.lower(), tok, start))
        last_end = m.end()
    return out


def _fold_negation(tok: str) -> str:
    """don't -> dont; then n't forms and 'not' count as negation."""
    return tok.replace("'", "")


def _stem(tok: str) -> str:
    t = tok.replace("'", "")
    if t.endswith("ies") and len(t) > 4:
        return t[:-3] + "y"
    if t.endswith("s") and not t.endswith("ss") and len(t) > 3:
        return t[:-1]
    return t


def _canon_number(s: str) -> str:
    s = s.replace(",", "")
    try:
        d = Decimal(s).normalize()
    except InvalidOperation:
        return s
    return format(d, "f")


# ---------------------------------------------------------------- features

class _Features:
    """Everything the rules compare, extracted once per question."""

    def __init__(self, text: str):
        self.text = _prepare(text)
        toks = _tokens_with_case(self.text)
        self.words = [t for t, _, _ in toks]
        self.vocab = {_stem(w) for w in self.words}
        self.squashed = re.sub(r"[\s\-]+", "", self.text.lower())
        self.negations = sum(1 for w in self.words if _fold_negation(w) in NEGATIONS or w.endswith("n't"))
        self.numbers: collections.Counter = collections.Counter()
        self.quantities: collections.Counter = collections.Counter()
        self.units: set[str] = set()
        self.dates: set[str] = set()
        self._scan_numbers_units_dates()
        self.entities = self._entities(toks)
        self.places = self._places()
        self.quotes = self._quotes()

    # numbers, units, dates ---------------------------------------------
    def _scan_numbers_units_dates(self) -> None:
        w = self.words
        n = len(w)
        number_at: dict[int, str] = {}  # token index of the number's last token -> canonical value
        i = 0
        while i < n:
            tok = w[i]
            if _DIGIT_RE.match(tok):
                number_at[i] = tok if ":" in tok else _canon_number(tok)
                i += 1
                continue
            if tok in NUMBER_WORDS and not (tok == "one" and i > 0 and w[i - 1] in _ONE_PRONOUN_BEFORE):
                j = i
                while j + 1 < n and w[j + 1] in NUMBER_WORDS:
                    j += 1
                values = _parse_number_run(w[i:j + 1])
                # "twenty first" -> 21st
                if j + 1 < n and w[j + 1] in ORDINAL_WORDS and NUMBER_WORDS[w[j]][1] == "tens" \
                        and ORDINAL_WORDS[w[j + 1]] < 10:
                    values[-1] = f"#{int(values[-1]) + ORDINAL_WORDS[w[j + 1]]}"
                    j += 1
                for v in values[:-1]:
                    self.numbers[v] += 1
                number_at[j] = values[-1]
                i = j + 1
                continue
            if tok in ORDINAL_WORDS:
                prev = w[i - 1] if i > 0 else ""
                a_unit = tok == "second" and (prev in ("a", "one", "per", "every", "each")
                                              or prev in NUMBER_WORDS or _DIGIT_RE.match(prev))
                if not a_unit:  # "the second floor" is an ordinal, "30 second timer" a unit
                    number_at[i] = f"#{ORDINAL_WORDS[tok]}"
            i += 1

        consumed: set[int] = set()
        for j, val in sorted(number_at.items()):
            nxt = w[j + 1] if j + 1 < n else ""
            prev = w[j - 1] if j > 0 else ""
            if val.startswith("#"):
                self.numbers[val] += 1
                continue
            if nxt in ("am", "pm"):
                self.numbers[_clock(val, nxt)] += 1
                consumed.add(j + 1)
                continue
            if nxt in ("o'clock", "oclock"):
                self.numbers[_clock(val, None)] += 1
                continue
            if ":" in val:
                self.numbers[_clock(val, None)] += 1
                continue
            if nxt in ("st", "nd", "rd", "th"):
                self.numbers[f"#{val}"] += 1
                consumed.add(j + 1)
                continue
            if nxt in ("%", "percent", "pct"):
                self.numbers[f"{val}%"] += 1
                consumed.add(j + 1)
                continue
            self.numbers[val] += 1
            unit = None
            if nxt in UNIT_WORDS:
                unit = UNIT_WORDS[nxt]
            elif nxt in BOUND_UNIT_WORDS:
                unit = BOUND_UNIT_WORDS[nxt]
            elif prev in UNIT_WORDS and not prev.isalpha():  # "$5", "€20"
                unit = UNIT_WORDS[prev]
            if unit == "thousand":
                self.numbers[val] -= 1
                self.numbers[_canon_number(str(Decimal(val) * 1000))] += 1
                consumed.add(j + 1)
            elif unit:
                self.quantities[f"{val} {unit}"] += 1
                self.units.add(unit)
                consumed.add(j + 1)

        for i, tok in enumerate(w):
            if i in consumed:
                continue
            if tok in _TIMES_OF_DAY:
                self.numbers[_TIMES_OF_DAY[tok]] += 1
            if tok in UNIT_WORDS and tok != "won":
                self.units.add(UNIT_WORDS[tok])
            elif tok == "won" and i + 1 < n and w[i + 1] in ("in", "to", "for"):
                self.units.add("krw")  # "dollars won in 15"; otherwise the verb
            prev = w[i - 1] if i > 0 else ""
            nxt = w[i + 1] if i + 1 < n else ""
            date = None
            base = tok[:-2] if tok.endswith("'s") else tok
            if base.endswith("s") and base[:-1] in WEEKDAYS:  # "mondays"
                base = base[:-1]
            if base in WEEKDAYS:
                date = base
            elif base in MONTHS or base in _MONTH_ABBR:
                month = _MONTH_ABBR.get(base, base)
                near_number = any(k in number_at for k in (i - 1, i + 1)) or nxt in ORDINAL_WORDS
                if base not in _AMBIGUOUS_MONTHS or near_number or prev in _MONTH_CONTEXT:
                    date = month
            elif base in RELATIVE_TIME:
                date = RELATIVE_TIME[base]
            if date:
                self.dates.add(date)
                if prev in _TIME_MODIFIERS:
                    self.dates.add(f"{prev} {date}")

    # entities ------------------------------------------------------------
    def _entities(self, toks) -> set[str]:
        ents = set()
        for low, orig, at_start in toks:
            if at_start or not orig[:1].isupper() or low in ("i", "i'm", "i'd", "i'll", "i've", "ok"):
                continue
            if low in STOPWORDS or low in NUMBER_WORDS:
                continue
            ents.add(_stem(low))
        for m in _MIXED_RE.finditer(self.text.lower()):
            tok = m.group(0).replace("-", "")
            if any(c.isdigit() for c in tok) and any(c.isalpha() for c in tok) and not _is_number_with_suffix(tok):
                ents.add("#" + tok)
        return ents

    def has_entity(self, ent: str) -> bool:
        if ent.startswith("#"):
            return ent[1:] in self.squashed
        return ent in self.vocab

    # places ----------------------------------------------------------------
    def _places(self) -> set[str]:
        w = self.words
        places = set()
        for i, tok in enumerate(w):
            prev = w[i - 1] if i > 0 else ""
            nxt = w[i + 1] if i + 1 < len(w) else ""
            if tok == "to":
                if prev not in _TO_AFTER and nxt not in _DETERMINERS:
                    continue
            elif tok not in _PLACE_PREPS:
                continue
            elif tok == "on" and prev in _PHRASAL_ON:
                continue
            j = i + 1
            while j < len(w) and w[j] in _DETERMINERS:
                j += 1
            taken = 0
            while j < len(w) and taken < 3 and _is_place_word(w[j]):
                places.add(_stem(w[j]))
                j += 1
                taken += 1
        return places

    # quotes ----------------------------------------------------------------
    def _quotes(self) -> list[str]:
        found = re.findall(r'"([^"]+)"', self.text)
        found += re.findall(r"(?:^|(?<=[\s,:;(]))'(.+?)'(?=$|[\s,.!?;:)])", self.text)
        out = []
        for q in found:
            words = [t for t, _, _ in _tokens_with_case(q)]
            if words:
                out.append(" ".join(words))
        return out


def _is_number_with_suffix(tok: str) -> bool:
    m = re.fullmatch(r"(\d+)([a-z]*)", tok)
    if not m:
        return False
    suffix = m.group(2)
    return (_NUMBER_SUFFIX_RE.fullmatch(tok) is not None or suffix in UNIT_WORDS or suffix in BOUND_UNIT_WORDS
            or suffix in ("o'clock", "oclock"))


def _is_place_word(tok: str) -> bool:
    return (tok.isalpha() or "'" in tok) and tok not in STOPWORDS and tok not in NUMBER_WORDS \
        and tok not in ORDINAL_WORDS and tok not in UNIT_WORDS and tok not in RELATIVE_TIME \
        and tok not in _TIMES_OF_DAY and tok not in WEEKDAYS and tok not in MONTHS \
        and _fold_negation(tok) not in NEGATIONS and tok not in _PLACE_PREPS and tok != "to"


def _parse_number_run(words: list[str]) -> list[str]:
    """['twenty', 'five'] -> ['25']; ['three', 'thirty'] -> ['3', '30']; ['two', 'hundred', 'fifty'] -> ['250']."""
    out: list[int] = []
    total, cur, prev = 0, 0, None
    for word in words:
        v, kind = NUMBER_WORDS[word]
        if kind == "scale":
            if v == 100:
                cur = (cur or 1) * 100
            else:
                total += (cur or 1) * v
                cur = 0
            prev = "scale"
            continue
        if not (prev is None or prev == "scale" or (prev == "tens" and kind == "unit" and v > 0)):
            out.append(total + cur)
            total, cur = 0, 0
        cur += v
        prev = kind
    out.append(total + cur)
    return [str(v) for v in out]


def _clock(val: str, ampm: str | None) -> str:
    """'3','pm' -> 't:15:00'; '15:00' -> 't:15:00'; '615','am' -> 't:06:15'; '5:00' alone -> 't?5:00' (12h unknown)."""
    if ":" in val:
        h_s, m_s = val.split(":", 1)
    elif ampm is not None and len(val) in (3, 4):
        h_s, m_s = val[:-2], val[-2:]
    else:
        h_s, m_s = val.split(".")[0], "00"
    try:
        h, m = int(h_s), int(m_s)
    except ValueError:
        return f"t?{val}"
    if ampm in ("am", "pm"):
        h = h % 12 + (12 if ampm == "pm" else 0)
    elif ampm is None and 1 <= h <= 12:
        return f"t?{h}:{m:02d}"
    return f"t:{h:02d}:{m:02d}"


# ---------------------------------------------------------------- the checks

def _diff_text(a: collections.Counter | set, b: collections.Counter | set) -> str:
    def fmt(x):
        items = sorted(x.elements()) if isinstance(x, collections.Counter) else sorted(x)
        return "{" + ", ".join(items) + "}" if items else "{}"
    return f"{fmt(a)} vs {fmt(b)}"


def _check_negation(a: _Features, b: _Features) -> str | None:
    if a.negations != b.negations:
        return f"negation differs ({a.negations} vs {b.negations} negating words)"
    return None


def _check_opposites(a: _Features, b: _Features) -> str | None:
    wa, wb = set(a.words), set(b.words)
    for side1, side2 in OPPOSITES:
        a1, a2, b1, b2 = bool(wa & side1), bool(wa & side2), bool(wb & side1), bool(wb & side2)
        if (a1 and not a2 and b2 and not b1) or (a2 and not a1 and b1 and not b2):
            x = sorted(wa & (side1 | side2))[0]
            y = sorted(wb & (side1 | side2))[0]
            return f"opposite words: '{x}' vs '{y}'"
    return None


def _check_numbers(a: _Features, b: _Features) -> str | None:
    na, nb = +a.numbers, +b.numbers
    if na != nb:
        return f"numbers differ: {_diff_text(na, nb)}"
    return None


def _check_units(a: _Features, b: _Features) -> str | None:
    if a.quantities != b.quantities:
        return f"quantities differ: {_diff_text(a.quantities, b.quantities)}"
    if a.units != b.units:
        return f"units or currencies differ: {_diff_text(a.units, b.units)}"
    return None


def _check_dates(a: _Features, b: _Features) -> str | None:
    if a.dates != b.dates:
        return f"dates or times of day differ: {_diff_text(a.dates, b.dates)}"
    return None


def _check_entities(a: _Features, b: _Features) -> str | None:
    for x, y in ((a, b), (b, a)):
        for ent in sorted(x.entities):
            if not y.has_entity(ent):
                return f"named entity '{ent.lstrip('#')}' is only in one question"
    return None


def _check_places(a: _Features, b: _Features) -> str | None:
    for x, y in ((a, b), (b, a)):
        for word in sorted(x.places):
            if word not in y.vocab:
                return f"place or object '{word}' is only in one question"
    return None


def _check_quotes(a: _Features, b: _Features) -> str | None:
    if a.quotes and b.quotes:
        if sorted(a.quotes) != sorted(b.quotes):
            return f"quoted text differs: {a.quotes} vs {b.quotes}"
        return None
    for x, y in ((a, b), (b, a)):
        joined = " " + " ".join(y.words) + " "
        for q in x.quotes:
            if f" {q} " not in joined:
                return f"quoted text '{q}' is only in one question"
    return None


CHECKS = (_check_negation, _check_opposites, _check_numbers, _check_units, _check_dates,
          _check_entities, _check_places, _check_quotes)


def answers_compatible(new_question: str, cached_question: str) -> tuple[bool, str]:
    """(True, '') when a cached answer to cached_question may answer new_question; else (False, reason)."""
    a, b = _Features(new_question), _Features(cached_question)
    for check in CHECKS:
        reason = check(a, b)
        if reason:
            return False, reason
    return True, ""
