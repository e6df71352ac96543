"""answers_compatible on hand-written cases and on real CLINC150 phrasings.

Run with -s to see the measured refusal and acceptance rates.
"""
import collections
import itertools
import json
import os
import re

import pytest
from hypothesis import given, settings, strategies as st

from simllm_ros.cache.answer_guard import answers_compatible

from simllm_ros.workloads import find_clinc

CLINC = find_clinc()


def refused(a, b):
    ok, reason = answers_compatible(a, b)
    assert ok is False and reason, (a, b)
    ok2, reason2 = answers_compatible(b, a)
    assert ok2 is False and reason2, (b, a)
    return reason


def accepted(a, b):
    assert answers_compatible(a, b) == (True, ""), (a, b, answers_compatible(a, b))
    assert answers_compatible(b, a) == (True, ""), (b, a)


# ---------------------------------------------------------------- the issue's examples

def test_issue_examples_refused():
    assert "open" in refused("is Elm Street open", "is Elm Street closed")
    assert "oak" in refused("is Oak Street open", "is Elm Street open")
    assert "number" in refused("set an alarm at 3 pm", "set an alarm at 5 pm")


def test_identical_and_trivially_rephrased_accepted():
    accepted("is Elm Street open", "is Elm Street open")
    accepted("is Elm Street open?", "Is elm street open")
    accepted("set an alarm at 3 pm", "please set an alarm for 3 p.m.")


# ---------------------------------------------------------------- each rule

@pytest.mark.parametrize("a,b", [
    ("is the door locked", "is the door not locked"),
    ("is the door locked", "isn't the door locked"),
    ("can you open the gate", "can't you open the gate"),
    ("do we have milk", "do we have no milk"),
    ("coffee with sugar", "coffee without sugar"),
    ("has the robot ever been charged", "has the robot never been charged"),
])
def test_negation_refused(a, b):
    assert "negation" in refused(a, b)


@pytest.mark.parametrize("a,b", [
    ("turn on the kitchen light", "turn off the kitchen light"),
    ("start the vacuum", "stop the vacuum"),
    ("enable the camera", "disable the camera"),
    ("increase the volume", "decrease the volume"),
    ("turn the volume up", "turn the volume down"),
    ("what did I do before lunch", "what did I do after lunch"),
    ("lock the front door", "unlock the front door"),
    ("add milk to my shopping list", "remove milk from my shopping list"),
    ("book a table for dinner", "cancel a table for dinner"),
    ("is the pharmacy open", "is the pharmacy closed"),
])
def test_opposites_refused(a, b):
    assert "opposite" in refused(a, b)


@pytest.mark.parametrize("a,b", [
    ("set a timer for 5 minutes", "set a timer for 7 minutes"),
    ("set a timer for five minutes", "set a timer for 6 minutes"),
    ("wake me at 3 pm", "wake me at 3 am"),
    ("wake me at 15:00", "wake me at 5 pm"),
    ("go to the third floor", "go to the fourth floor"),
    ("what's on my calendar for march 3rd", "what's on my calendar for march 4th"),
    ("dim the lights to 50%", "dim the lights to 30 percent"),
    ("move 2 boxes", "move 2 boxes and 3 crates"),
    ("twenty five degrees", "twenty degrees"),
])
def test_numbers_refused(a, b):
    assert "number" in refused(a, b)


@pytest.mark.parametrize("a,b", [
    ("set a timer for 5 minutes", "set a 5 minute timer"),
    ("set a timer for five minutes", "set a timer for 5 minutes"),
    ("wake me at 3 pm", "wake me at 15:00"),
    ("wake me at 3pm", "wake me at three pm"),
    ("dim the lights to 50%", "dim the lights to 50 percent"),
    ("go to the third floor", "go to the 3rd floor"),
    ("how far is 10,000 steps", "how far is 10000 steps"),
    ("which one is heavier", "which is heavier"),  # "one" as a pronoun is not a number
])
def test_same_numbers_in_other_forms_accepted(a, b):
    accepted(a, b)


@pytest.mark.parametrize("a,b,word", [
    ("set a timer for 5 minutes", "set a timer for 5 hours", "quantities"),
    ("convert 20 dollars to euros", "convert 20 euros to dollars", "quantities"),
    ("what is $5 in yen", "what is 5 euros in yen", "quantities"),
    ("how many miles to the station", "how many kilometers to the station", "units"),
    ("what is the temperature in celsius", "what is the temperature in fahrenheit", "units"),
])
def test_units_refused(a, b, word):
    assert word in refused(a, b)


def test_currency_symbol_and_word_accepted():
    accepted("convert $20 to euros", "convert 20 dollars to euros")


@pytest.mark.parametrize("a,b", [
    ("what's the weather today", "what's the weather tomorrow"),
    ("will it rain tonight", "will it rain today"),
    ("what do I have on Monday", "what do I have on Tuesday"),
    ("any meetings in june", "any meetings in july"),
    ("what's on my calendar next week", "what's on my calendar this week"),
    ("what's the weather this weekend", "what's the weather"),
])
def test_dates_refused(a, b):
    assert "dates" in refused(a, b)


def test_may_the_verb_is_not_a_month():
    accepted("may I ask your name", "can I ask your name")


@pytest.mark.parametrize("a,b", [
    ("how do I get to Oak Street", "how do I get to Elm Street"),
    ("what time does Walmart close", "what time does Target close"),
    ("is flight UA123 on time", "is flight DL123 on time"),
    ("play music by Queen", "play music by Abba"),
])
def test_entities_refused(a, b):
    assert "entity" in refused(a, b)


def test_entity_case_does_not_matter():
    accepted("how do I get to Oak Street", "how do i get to oak street")


@pytest.mark.parametrize("a,b", [
    ("what's the weather like in boston", "what's the weather like in paris"),
    ("how do i get to the airport", "how do i get to the train station"),
    ("is there traffic on my way to work", "is there traffic on my way to the beach"),
    ("what's the weather like", "what's the weather like in paris"),
])
def test_lowercase_places_refused(a, b):
    assert "place" in refused(a, b)


def test_quotes_compared():
    assert "quoted" in refused("how do i say 'where is the library' in french", "how do i say 'where is the station' in french")
    assert "quoted" in refused('translate "where is the door" to german', 'translate "who is the boss" to german')
    accepted("how do i say 'thank you' in french", "how do i say thank you in french")


# ---------------------------------------------------------------- properties

@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200), st.text(max_size=200))
def test_never_raises_and_symmetric(a, b):
    ok, reason = answers_compatible(a, b)
    assert isinstance(ok, bool) and isinstance(reason, str)
    assert ok == (reason == "")
    assert answers_compatible(b, a)[0] == ok


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_reflexive(a):
    assert answers_compatible(a, a) == (True, "")


# ---------------------------------------------------------------- CLINC150

def load_clinc():
    if not os.path.exists(CLINC):
        pytest.skip(f"{CLINC} not available")
    by_intent = collections.defaultdict(list)
    with open(CLINC, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            by_intent[row["intent"]].append(row["text"])
    return by_intent


# Independent of the guard's parser on purpose: digits and the common number
# words, mapped to integers. "one" is left out because it is mostly a pronoun.
_TEST_NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero _ two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
_TEST_NUMBER_WORDS.update({"thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "hundred": 100, "thousand": 1000})


def numeric_tokens(text):
    out = collections.Counter()
    for m in re.finditer(r"\d[\d,]*(?:\.\d+)?|[a-z]+", text.lower()):
        s = m.group(0)
        if s[0].isdigit():
            for part in re.split(r"\D+", s.replace(",", "")):
                if part:
                    out[int(part)] += 1
        elif s in _TEST_NUMBER_WORDS and s != "_":
            out[_TEST_NUMBER_WORDS[s]] += 1
    return out


SLOT_INTENTS = ["weather", "traffic", "directions", "gas", "timer", "alarm", "translate", "exchange_rate", "calendar"]
PARAPHRASE_INTENTS = ["what_is_your_name", "greeting", "goodbye", "tell_joke", "meaning_of_life", "who_made_you"]


def test_clinc_pairs_with_different_numbers_all_refused():
    by_intent = load_clinc()
    total = 0
    wrongly_accepted = []
    lines = []
    for intent in SLOT_INTENTS:
        n = 0
        for a, b in itertools.combinations(by_intent[intent], 2):
            if numeric_tokens(a) == numeric_tokens(b):
                continue
            n += 1
            if answers_compatible(a, b)[0]:
                wrongly_accepted.append((intent, a, b))
        lines.append(f"{intent}={n}")
        total += n
    rate = 1 - len(wrongly_accepted) / total
    print(f"\n[answer_guard] CLINC150 same-intent pairs differing in numbers: {total} "
          f"({', '.join(lines)}); refused {total - len(wrongly_accepted)} = {rate:.2%}")
    assert total > 5000  # the selection really found pairs
    assert wrongly_accepted == []


# verbatim from train.jsonl: same intent, different place / number / date / language / quote
CLINC_REFUSE = [
    ("what are the conditions like in orlando", "what are the conditions like in sarasota"),
    ("what's the temperature like in tampa", "what is the weather like in denver"),
    ("what is the traffic like on the way to makaha", "what is the traffic like on the way to kaneohe"),
    ("is there traffic on dove road", "is there traffic on bramble lane"),
    ("how do i get to the beach by bus", "how do i get to the mall by bus"),
    ("how do i get to the museum on foot", "how do i get to the museum by bus"),
    ("how do you say thank you in spanish", "how do you say thank you in german"),
    ('how do they say "who is your father" in german', 'how do they say "where\'s the bathroom" in spanish'),
    ("how do they say hello in germany", "how do they say no in germany"),
    ("how many dollars can i exchange for 25 euros", "how many dollars can i exchange for 75 euros"),
    ("how many dollars can i exchange for 10 yen", "how many dollars can i exchange for 10000 yen"),
    ("how many dollars can i exchange for 10000 rubles", "how many dollars can i exchange for 10000 yen"),
    ("what is the weather going to be like today", "what is the weather going to be like tomorrow"),
    ("is it going to rain today", "is it going to rain tonight"),
    ("please set a timer for 6 minutes", "set a timer for 5 minutes"),
    ("set a timer for two hours", "set a timer for 5 minutes"),
    ("does my calendar have anything for january 1st", "anything on the schedule for october 14th"),
    ("what is on my schedule for tomorrow", "what is on my calendar next sunday"),
    ("i need an alarm for 6am", "i need alarms set for 6am and 615am"),
]

# verbatim from train.jsonl: same intent, same details -> should be accepted
CLINC_ACCEPT = [
    ("how do you say hello in french", "how would i say hello in french"),
    ("set a 10 minute timer", "i need a 10 minute timer"),
    ("what is currently on my calendar for friday the 1st",
     "i need to know what is currently on my calendar for friday the 1st"),
    ("what do i have planned on my calendar for next sunday", "show me my calendar for next sunday"),
    ("what is my current gas level", "what's my current fuel level"),
    ("i need an alarm for 6am", "set an alarm for 6am, please"),
]


def test_clinc_hand_picked_pairs():
    by_intent = load_clinc()
    all_texts = {t for texts in by_intent.values() for t in texts}
    for a, b in CLINC_REFUSE + CLINC_ACCEPT:
        assert a in all_texts and b in all_texts, "hand-picked pairs must be verbatim from the file"
    reasons = [refused(a, b) for a, b in CLINC_REFUSE]
    print(f"\n[answer_guard] hand-picked CLINC150 pairs refused: {len(reasons)}/{len(CLINC_REFUSE)}")
    for (a, b), r in zip(CLINC_REFUSE, reasons):
        print(f"    {a!r} / {b!r}: {r}")
    for a, b in CLINC_ACCEPT:
        accepted(a, b)


def test_clinc_plain_paraphrases_mostly_accepted():
    by_intent = load_clinc()
    total = accepted_n = 0
    per_intent = []
    for intent in PARAPHRASE_INTENTS:
        pairs = list(itertools.combinations(by_intent[intent], 2))
        n_ok = sum(answers_compatible(a, b)[0] for a, b in pairs)
        per_intent.append(f"{intent}={n_ok / len(pairs):.0%}")
        total += len(pairs)
        accepted_n += n_ok
    rate = accepted_n / total
    print(f"\n[answer_guard] CLINC150 same-intent chit-chat pairs accepted: {accepted_n}/{total} = {rate:.1%} "
          f"({', '.join(per_intent)})")
    assert rate > 0.5
