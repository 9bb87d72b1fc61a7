#!/usr/bin/env perl
# Scans C++ headers for function definitions that would break the one-definition rule when the
# header is included by two translation units: every function defined in a header must be
# inline, constexpr, a template (not a full specialisation `template <>`), or a member function
# defined inside its class body. Prints one line per offending definition and a summary; exits
# 1 when any is found. Used by scripts/check_inline.sh.
#
# The scan is textual: comments, string literals and preprocessor lines are removed, gattn's
# GATTN_BEGIN_ISA_NAMESPACE / GATTN_END_ISA_NAMESPACE macros are read as the namespaces they
# open and close, and braces are tracked to know whether a `{` opens a namespace, a class, a
# function body or something else (an initializer, a block inside a function).
use strict;
use warnings;

our $verbose;
my ($files, $ns_defs, $member_defs, $inline_n, $constexpr_n, $template_n, $errors) = (0) x 7;

sub strip {
    my ($text) = @_;
    my $out = '';
    my $i = 0;
    my $n = length $text;
    while ($i < $n) {
        my $c = substr($text, $i, 1);
        my $two = substr($text, $i, 2);
        if ($two eq '//') {
            my $e = index($text, "\n", $i);
            $e = $n if $e < 0;
            $i = $e;
        } elsif ($two eq '/*') {
            my $e = index($text, '*/', $i + 2);
            $e = $n - 2 if $e < 0;
            my $skipped = substr($text, $i, $e + 2 - $i);
            $out .= "\n" x ($skipped =~ tr/\n//);
            $i = $e + 2;
        } elsif ($c eq '"' || $c eq "'") {
            # Raw strings R"(...)" are not used in gattn's headers; plain literals are skipped.
            my $j = $i + 1;
            while ($j < $n && substr($text, $j, 1) ne $c) {
                $j++ if substr($text, $j, 1) eq '\\';
                $j++;
            }
            $out .= $c eq '"' ? '""' : "''";
            $i = $j + 1;
        } else {
            $out .= $c;
            $i++;
        }
    }
    # Preprocessor lines go, with their continuation lines; the line count stays.
    my @lines = split /\n/, $out, -1;
    my $continued = 0;
    for (@lines) {
        my $pp = $continued || /^\s*#/;
        $continued = $pp && /\\\s*$/;
        $_ = '' if $pp;
    }
    $out = join "\n", @lines;
    $out =~ s/\bGATTN_BEGIN_ISA_NAMESPACE\b/namespace gattn { inline namespace GATTN_ISA {/g;
    $out =~ s/\bGATTN_END_ISA_NAMESPACE\b/} }/g;
    return $out;
}

# Removes `template <...>` heads (balanced angle brackets) and returns (rest, had_template,
# had_full_specialisation).
sub template_heads {
    my ($s) = @_;
    my ($tmpl, $spec) = (0, 0);
    while ($s =~ /\btemplate\s*</g) {
        my $start = $-[0];
        my $j = pos($s);
        my $depth = 1;
        my $body_start = $j;
        while ($j < length($s) && $depth > 0) {
            my $c = substr($s, $j, 1);
            $depth++ if $c eq '<';
            $depth-- if $c eq '>';
            $j++;
        }
        my $params = substr($s, $body_start, $j - 1 - $body_start);
        if ($params =~ /^\s*$/) { $spec = 1 } else { $tmpl = 1 }
        substr($s, $start, $j - $start) = ' ';
        pos($s) = $start;
    }
    return ($s, $tmpl, $spec);
}

# True when the statement text before `{` is a function head: `... name(params) qualifiers`,
# possibly with a trailing return type or a constructor's member initializer list.
sub is_function_head {
    my ($s) = @_;
    $s =~ s/\boperator\s*(\(\)|\[\]|[^\s(]+)\s*\(/operator_fn(/g;  # operator==( etc.
    # `=` outside parentheses: a variable initialised with braces or a lambda.
    my $depth = 0;
    for my $c (split //, $s) {
        $depth++ if $c eq '(';
        $depth-- if $c eq ')';
        return 0 if $c eq '=' && $depth == 0;
    }
    return 0 unless $s =~ /(?:[A-Za-z_~][\w:]*|>)\s*\(/;   # name( or name<args>(
    return 0 if $s =~ /^\s*(if|for|while|switch|catch|return|do|else)\b/;
    # After the parameter list: qualifiers, noexcept(...), -> type, or `: member(init), ...`.
    return 1 if $s =~ /\)\s*(const|volatile|noexcept(\s*\(.*\))?|override|final|&|&&|\s)*\s*$/s;
    return 1 if $s =~ /\)\s*(const|noexcept(\s*\([^)]*\))?|\s)*->\s*[^{;]+$/s;
    return 1 if $s =~ /\)\s*(noexcept(\s*\([^)]*\))?\s*)?:\s*[\w:]+\s*[({].*[)}]\s*$/s;
    return 0;
}

sub check_file {
    my ($path) = @_;
    open my $fh, '<', $path or die "$path: $!";
    local $/;
    my $text = strip(<$fh>);
    close $fh;
    $files++;
    my @scope = ();  # 'ns', 'class', 'func', 'other'
    my $buf = '';
    my $buf_line = 0;
    my $line = 1;
    my $paren = 0;  # parentheses open in $buf: braces inside them (`= {}`) are not scopes
    my $init_brace = 0;  # braces open in a constructor's member initializer
    for my $c (split //, $text) {
        if ($c eq "\n") {
            $line++;
            $buf .= ' ';
            next;
        }
        $paren++ if $c eq '(';
        $paren-- if $c eq ')' && $paren > 0;
        if ($paren > 0 && ($c eq '{' || $c eq '}' || $c eq ';')) {
            $buf .= $c;
            next;
        }
        # A member brace-initializer in a constructor's init list, `S() : a{1}, b{2} {`.
        my $top_kind = @scope ? $scope[-1] : 'ns';
        if ($c eq '{' && $top_kind !~ /^(func|other)$/ &&
            ($init_brace > 0 || $buf =~ /\)\s*(noexcept\s*)?:(?!:)[^;]*[\w>]\s*$/)) {
            $init_brace++;
            $buf .= $c;
            next;
        }
        if ($c eq '}' && $init_brace > 0) {
            $init_brace--;
            $buf .= $c;
            next;
        }
        if ($c eq ';') {
            ($buf, $paren) = ('', 0) unless @scope && $scope[-1] =~ /^(func|other)$/;
            next;
        }
        if ($c eq '}') {
            pop @scope;
            ($buf, $paren) = ('', 0);
            next;
        }
        if ($c ne '{') {
            $buf_line = $line if $buf =~ /^\s*$/ && $c =~ /\S/;
            $buf .= $c;
            next;
        }
        my $top = @scope ? $scope[-1] : 'ns';
        $top = 'ns' if $top eq 'anon';
        if ($top eq 'func' || $top eq 'other') {
            push @scope, 'other';
            ($buf, $paren) = ('', 0);
            next;
        }
        my ($head, $tmpl, $spec) = template_heads($buf);
        my $kind;
        if ($head =~ /^\s*(inline\s+)?namespace\b[^(]*$/ || $head =~ /^\s*extern\s*""\s*$/) {
            $kind = 'ns';
        } elsif (is_function_head($head)) {
            $kind = 'func';
            (my $name = $head) =~ s/\s+/ /g;
            $name =~ s/^\s+|\s+$//g;
            $name = $1 if $name =~ /(operator\s*(?:\(\)|[^\s(]+)|[~\w:]+(?:\s*<[^()]*>)?)\s*\(/;
            print "$path:$buf_line: $top-scope function $name\n" if $verbose;
            if ($top eq 'class') {
                $member_defs++;
            } else {
                $ns_defs++;
                my $where = "$path:$buf_line";
                if ($spec) {
                    print "$where: $name: a full specialisation `template <>` is not a template; mark it inline\n";
                    $errors++;
                } elsif ($head =~ /\bstatic\b/ || grep { $_ eq 'anon' } @scope) {
                    print "$where: $name: internal linkage (static or unnamed namespace) in a header; make it inline\n";
                    $errors++;
                } elsif ($head =~ /\binline\b/) {
                    $inline_n++;
                } elsif ($head =~ /\bconstexpr\b/) {
                    $constexpr_n++;
                } elsif ($tmpl) {
                    $template_n++;
                } else {
                    print "$where: $name: defined outside a class without inline, constexpr or template\n";
                    $errors++;
                }
            }
        } elsif ($head =~ /\b(class|struct|union|enum)\b/) {
            $kind = 'class';
        } else {
            $kind = 'other';
        }
        $kind = 'anon' if $kind eq 'ns' && $head =~ /^\s*namespace\s*$/;
        push @scope, $kind;
        ($buf, $paren) = ('', 0);
    }
}

$verbose = 0;
if (@ARGV && $ARGV[0] eq '-v') { $verbose = 1; shift @ARGV; }
die "usage: check_inline.pl [-v] <header> ...\n" unless @ARGV;
check_file($_) for @ARGV;
printf "%d headers: %d functions defined outside a class (inline %d, constexpr %d, template %d), " .
       "%d members defined in their class; %d problem(s)\n",
       $files, $ns_defs, $inline_n, $constexpr_n, $template_n, $member_defs, $errors;
exit($errors ? 1 : 0);
